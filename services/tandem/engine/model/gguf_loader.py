"""GGUF checkpoints: read with the ``gguf`` package, dequantize, convert to a model folder.

A ``.gguf`` file is converted once into an ordinary Hugging Face folder (``config.json``,
``model.safetensors`` in float32, ``tokenizer.json``, ``tokenizer_config.json`` with the
chat template, ``generation_config.json``) in the tandem cache; every later load, and
every Ray worker, reads that folder through the one safetensors loader. Converting costs
seconds (parsing the metadata and dequantizing); loading the cached folder is a
memory-mapped read.

llama.cpp stores the Q and K projections of Llama-architecture models with the rows of
each head interleaved for its RoPE kernel; they are un-permuted here, as ``gguf`` /
``transformers`` do, so the folder holds the Hugging Face layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.cache_dir import cache_dir, publishing
from tandem.engine.progress import bar, progress
from tandem.text.gguf_tokenizer import eos_token_ids_from_gguf, tokenizer_from_gguf

FORMAT_VERSION = "v1"  # bump when the converted folder's contents change on purpose

# GGUF ``general.architecture`` -> (HF architecture, Q/K stored permuted by llama.cpp).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),  # also Mistral 7B and other Llama-shaped models
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# Tensor types dequantized at conversion (all through gguf.quants.dequantize).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_SKIPPED = ("rope_freqs.weight",)  # checked against the rope metadata instead
HASH_CHUNK = 8 * 2**20  # bytes per read while a GGUF file is hashed (content_key)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def read_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of a ``gguf.GGUFReader`` as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for the model the GGUF metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"the GGUF file lacks {arch}.{name}")
        return value

    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    kv_heads = key("attention.head_count_kv", heads)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": key("attention.key_length", hidden // heads),
        "vocab_size": key("vocab_size", len(tokens)),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key),
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids_from_gguf(meta) or None,
    }
    window = key("attention.sliding_window")
    if window:
        config["sliding_window"] = window
    return config


def _rope_scaling(key: Any) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope scaling {kind!r} (supported: none, linear)")
    return {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int,
                        original_context: int) -> dict[str, Any]:
    """The ``llama3`` rope scaling whose per-frequency divisors llama.cpp stored as ``rope_freqs``.

    factors: [head_dim // 2]. GGUF keeps only the divisors; the scaling factor is their
    maximum, and the low/high frequency factors are Llama 3's (1, 4), checked by
    recomputing every divisor. Raises ValueError when they do not reproduce the file's.
    """
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": int(original_context)}
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low, high = original_context / 1.0, original_context / 4.0
    smooth = (original_context / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(wavelen < high, 1.0, np.where(
        wavelen > low, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError("unsupported per-frequency RoPE factors (rope_freqs): they are not Llama 3's "
                         "scaling with low/high frequency factors 1 and 4")
    return scaling


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K projection.

    w: [n_head * head_dim, ...] as stored in the GGUF -> same shape, HF row order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A ``gguf.ReaderTensor`` as float32, in numpy (row-major) shape.

    Raises ``ValueError`` naming the tensor for types outside :data:`SUPPORTED_TYPES`.
    """
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r} has unsupported GGUF type {kind}; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for ones the model does not use."""
    if name in _SKIPPED:
        return None
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` and return it.

    Written into a temp folder beside ``out_dir`` and renamed into place, so concurrent
    converters are safe; an existing ``out_dir`` is kept as it is.
    """
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file

    src, out = Path(gguf_path), Path(out_dir)
    if (out / "config.json").is_file():
        return out
    if not is_gguf(src):
        raise ValueError(f"{src} is not a GGUF file")
    reader = GGUFReader(str(src))
    meta = read_metadata(reader)
    config = hf_config(meta)
    tok, tok_config = tokenizer_from_gguf(meta)
    permuted = ARCHITECTURES[meta["general.architecture"]][1]
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            original = meta.get(f"{meta['general.architecture']}.rope.scaling.original_context_length")
            config["rope_scaling"] = llama3_rope_scaling(
                dequantize_tensor(tensor).reshape(-1), config["rope_theta"], config["head_dim"],
                original or 8192)
    weights: dict[str, torch.Tensor] = {}
    for tensor in progress(reader.tensors, desc=f"converting {src.name}", unit="tensor"):
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        w = dequantize_tensor(tensor)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config["num_key_value_heads"])
        weights[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    config["attention_bias"] = any(n.endswith("o_proj.bias") for n in weights)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    with publishing(out, "converted model") as tmp:
        for name, obj in (("config.json", config), ("generation_config.json", generation),
                          ("tokenizer_config.json", tok_config)):
            (tmp / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tok.save(str(tmp / "tokenizer.json"))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": src.name})
    return out


def converted_path(gguf_path: str | Path) -> Path:
    """Folder of ``gguf_path``'s conversion in the cache, converting on first use.

    Keyed by the file's name and content, so a changed file converts anew and the same
    file installed again (a new path or modification time) reuses its conversion.
    """
    src = Path(gguf_path).resolve()
    return convert(src, cache_dir() / "models" / "gguf" / f"{src.stem}-{content_key(src)}-{FORMAT_VERSION}")


def content_key(src: Path) -> str:
    """A digest of ``src``'s bytes, remembered per path, size and modification time so
    that a large file is hashed once, not at every start."""
    st = src.stat()
    stamp = hashlib.sha256(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = cache_dir() / "models" / "gguf" / "content-keys" / stamp
    try:
        return memo.read_text(encoding="utf-8").strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(src, "rb") as f, bar(st.st_size, f"hashing {src.name}", unit="B", unit_scale=True,
                                   leave=False) as shown:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            shown.update(len(chunk))
    key = digest.hexdigest()[:16]
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{stamp}.{os.getpid()}.tmp")
    tmp.write_text(key + "\n", encoding="utf-8")
    os.replace(tmp, memo)  # atomic: a concurrent reader sees the whole key or none
    return key
