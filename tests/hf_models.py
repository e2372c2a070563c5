"""Random small Hugging Face checkpoints of each supported family, for parity tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 1024

ARCH_CONFIGS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=40)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}


def write_hf_checkpoint(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Save a random model of family ``arch`` with transformers' own ``save_pretrained``.

    Weights are scaled up from the default init so greedy decoding has clear
    winners (random models at std 0.02 produce near-ties that any reordering
    of float sums could flip).
    """
    import transformers

    config_cls, model_cls, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif "bias" in name:
                p.normal_(0, 0.05)
            else:
                p.uniform_(0.8, 1.2)  # norms
    model = model.to(dtype)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out
