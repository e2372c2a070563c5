"""Checkpoints the device check writes on the spot (nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.gpucheck.context import CheckContext
from tandem.engine.default_model import (LOGIT_STD, PROJ_STD_GAIN, ModelPreset, tensor_shapes,
                                           write_model)


def parity_checkpoint(ctx: CheckContext) -> Path:
    """The seeded random preset compared with transformers (float32 weights)."""
    return write_model(ctx.sizes.parity_preset, ctx.workdir / f"parity-{ctx.sizes.parity_preset}")


def speed_preset(ctx: CheckContext) -> ModelPreset:
    s = ctx.sizes
    return ModelPreset(s.speed_hidden, s.speed_intermediate, s.speed_layers, s.speed_heads,
                       s.speed_kv_heads, s.speed_vocab,
                       max(4096, 2 * (s.prefill_tokens + s.decode_context)), 500000.0, False)


def speed_checkpoint(ctx: CheckContext) -> Path:
    """A Llama-shaped model of ``ctx.sizes`` in the speed dtype, weights drawn on the device.

    The tokenizer and config come from the ``tiny`` preset, reshaped; the model's
    vocabulary may exceed the tokenizer's (prompts here are token ids).
    """
    out = ctx.workdir / "speed"
    if (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_file

    preset = speed_preset(ctx)
    tiny = write_model("tiny", ctx.workdir / "tiny")
    tmp = ctx.workdir / "speed.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    config = json.loads((tmp / "config.json").read_text())
    dtype = getattr(torch, ctx.speed_dtype)
    config.update(hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
                  num_hidden_layers=preset.num_hidden_layers,
                  num_attention_heads=preset.num_attention_heads,
                  num_key_value_heads=preset.num_key_value_heads, head_dim=preset.head_dim,
                  vocab_size=preset.vocab_size,
                  max_position_embeddings=preset.max_position_embeddings,
                  rope_theta=preset.rope_theta,
                  rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
                  tie_word_embeddings=False, torch_dtype=ctx.speed_dtype, dtype=ctx.speed_dtype)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    weights = {}
    for name, shape in tensor_shapes(preset).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
            continue
        gain = LOGIT_STD if name in ("model.embed_tokens.weight", "lm_head.weight") \
            else PROJ_STD_GAIN
        w = torch.randn(shape, generator=gen, device=ctx.device, dtype=torch.float32)
        weights[name] = (w * (gain / shape[1] ** 0.5)).to(dtype).cpu()
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out
