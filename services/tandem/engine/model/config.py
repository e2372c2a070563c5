"""Model hyper-parameters read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """What the Llama-family model code needs, normalised across families."""

    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain RoPE
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None
    torch_dtype: str  # the checkpoint's dtype name, e.g. "float32"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        family = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
        if cfg.get("use_sliding_window") and family in ("qwen2", "qwen3"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            family=family,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias if family in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            sliding_window=cfg.get("sliding_window") if family == "mistral" else None,
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge old (``rope_theta`` + ``rope_scaling``) and new (``rope_parameters``) spellings."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})  # HF's precedence
    if "rope_theta" not in params:
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
        if theta is not None:
            params["rope_theta"] = theta
    return params


def _rope_scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
    out = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = kind
    return out
