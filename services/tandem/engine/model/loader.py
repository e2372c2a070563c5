"""Load a Llama-family checkpoint from a local Hugging Face folder of safetensors."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.common.config import QUANTIZATIONS
from tandem.engine.kernels import cpu_features, kernel_choice, onednn
from tandem.engine.model.config import ModelConfig
from tandem.engine.model.llama import LlamaModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

log = logging.getLogger(__name__)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` is the checkpoint's dtype on GPU and float32 on CPU (no fast bf16 there)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(cfg.torch_dtype, torch.float32)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def fp32_activations(dtype: torch.dtype, device: torch.device, use_onednn: bool,
                     quantization: str | None) -> bool:
    """Whether a CPU model keeps its activations fp32 and stores weights in ``dtype``
    (packed bf16 for oneDNN, or int8): the CPU's kernel choice (``kernel_choice.choose``:
    fp32, int8, and bf16 where the CPU has native bf16 products), bf16 also needing oneDNN.
    Elsewhere (GPU, fp16, bf16 emulated) the model runs in ``dtype``."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    choice = kernel_choice.choose(cpu_features.cpu_flags(), str(dtype).removeprefix("torch."), quantization)
    if choice.activations != "float32":
        return False
    return dtype == torch.float32 or quantization is not None or (use_onednn and onednn.available(device))


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, use_onednn: bool = True,
               use_cpu_kernels: bool = True, quantization: str | None = None,
               weight_layout: str = "packed") -> LlamaModel:
    """Build the model on ``device`` with ``dtype`` weights and fill it from ``*.safetensors``.

    On CPU the activations stay fp32 where ``fp32_activations`` says so (weights for oneDNN
    in ``dtype`` and its ``weight_layout``, or int8 with
    ``quantization="int8"``); a bf16 model on a
    CPU without native bf16 runs wholly in bf16 on the torch path, with a warning.
    Raises ``FileNotFoundError`` / ``ValueError`` naming what is missing or unknown.
    """
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {path}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")
    if quantization is not None and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{quantization} weights need float32 or bfloat16 activations and KV, not {dtype}")
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"{quantization} weight quantization runs on CPU only, not {device}")
    mixed = fp32_activations(dtype, device, use_onednn, quantization)
    if device.type == "cpu" and dtype == torch.bfloat16 and not mixed:
        log.warning("bfloat16 on this CPU runs on the slow torch path (%s); float32 is faster "
                    "here", "no AVX-512 BF16 or AMX" if not cpu_features.has_native_bf16()
                    else "oneDNN off or unavailable")
    build = torch.float32 if mixed else dtype
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(build)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    needed = {name: p.numel() for name, p in params.items()}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                target = _target(key, cfg)
                if target is None:
                    continue
                name, row0 = target
                if name not in params:
                    raise ValueError(f"unexpected tensor {key!r} in {file.name} for {cfg.architecture}")
                src = f.get_tensor(key)
                dst = params[name].data
                expected = (_rows(key, cfg, dst.shape[0]),) + tuple(dst.shape[1:])
                if tuple(src.shape) != expected:
                    raise ValueError(f"tensor {key!r} has shape {tuple(src.shape)}, "
                                     f"expected {expected} ({cfg.architecture})")
                rows = dst[row0:row0 + src.shape[0]]
                rows.copy_(src.to(build))
                filled[name] += src.numel()
    missing = [n for n, c in filled.items() if c != needed[n]]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    model.init_rope(max_positions)
    if quantization == "int8":
        model.use_int8(native=use_cpu_kernels)
    elif mixed and use_onednn and onednn.available(device):
        model.use_onednn(dtype, native=use_cpu_kernels, layout=weight_layout)
    if mixed and dtype != torch.float32:  # the lookup table too (rows widened on lookup)
        model.embed_tokens.weight.data = model.embed_tokens.weight.data.to(dtype)
    if use_cpu_kernels:
        model.use_cpu_kernels()
    return model.eval()


def _target(key: str, cfg: ModelConfig) -> tuple[str, int] | None:
    """Map a checkpoint tensor name to (our parameter name, first row in it)."""
    if "rotary_emb" in key:
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", 0)
    if key in ("model.embed_tokens.weight", "model.norm.weight"):
        return key.removeprefix("model."), 0
    m = _LAYER.match(key)
    if m is None:
        return key, 0  # reported as unexpected by the caller
    i, rest = m.group(1), m.group(2)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {
        "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", q),
        "self_attn.v_proj": ("qkv_proj", q + kv), "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", cfg.intermediate_size),
    }
    module, _, leaf = rest.rpartition(".")
    if module in fused:
        name, row0 = fused[module]
        return f"layers.{i}.{name}.{leaf}", row0
    renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj",
               "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
    return f"layers.{i}.{renamed.get(module, module)}.{leaf}", 0


def _rows(key: str, cfg: ModelConfig, full: int) -> int:
    """Rows a checkpoint tensor fills in its (possibly fused) parameter."""
    if ".q_proj." in key:
        return cfg.num_heads * cfg.head_dim
    if ".k_proj." in key or ".v_proj." in key:
        return cfg.num_kv_heads * cfg.head_dim
    if ".gate_proj." in key or ".up_proj." in key:
        return cfg.intermediate_size
    return full
