"""A Hugging Face ``tokenizer.json`` rebuilt from a GGUF file's ``tokenizer.*`` metadata.

GGUF stores the vocabulary, merges, token types and special ids under llama.cpp's key
names, and names the pre-tokenizer (``tokenizer.ggml.pre``) instead of spelling it out.
This module turns those into a ``tokenizers.Tokenizer`` plus the ``tokenizer_config.json``
fields (special tokens, chat template) so :class:`tandem.text.tokenizer.Tokenizer`
reads a converted GGUF exactly like any other model folder.

Supported: byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2/3,
SmolLM, StarCoder, ...) and SentencePiece BPE with byte fallback (``"llama"``: Llama 2,
Mistral 7B, ...; merges rebuilt from the token scores as transformers does). Other
vocabularies raise a clear ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from tandem.text.tokenizer import byte_to_unicode

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre`` (as llama.cpp's llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Each entry: (split regex, digits split one by one before it).
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": (_GPT2_SPLIT, False),
    "gpt-2": (_GPT2_SPLIT, False),
    "gpt2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),
    "starcoder": (_GPT2_SPLIT, True),
    "refact": (_GPT2_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                         f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
    split, digits = _PRE_TOKENIZERS[pre]
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _byte_level(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not merges:
        raise ValueError("the GGUF file has no tokenizer.ggml.merges for its byte-level vocabulary")
    alphabet = set(byte_to_unicode().values())
    spelling = byte_to_unicode()
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):  # a few files store added tokens as raw text: respell them
        key = tok if set(tok) <= alphabet or types[i] in (_CONTROL, _USER_DEFINED) \
            else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    # Llama 3 vocabularies take a whole pre-token that is itself in the vocabulary.
    ignore_merges = _PRE_TOKENIZERS.get(pre, ("", False))[0] == _LLAMA3_SPLIT
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sp_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: best-scored merged piece first."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise ValueError("the GGUF file's SentencePiece vocabulary has no tokenizer.ggml.scores")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    piece_scores = {tok: float(scores[i]) for tok, i in vocab.items()}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_sp_merges(vocab, piece_scores), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """Build ``(tokenizer, tokenizer_config)`` from GGUF metadata.

    ``meta`` maps GGUF keys (``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``, ...)
    to plain Python values. Raises ``ValueError`` for vocabularies it cannot rebuild.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, types)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); "
                         "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])

    def named(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    bos = named("bos_token_id")
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    if add_bos:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": named("eos_token_id"),
        "unk_token": named("unknown_token_id"),
        "pad_token": named("padding_token_id"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return tok, {k: v for k, v in config.items() if v is not None}


def eos_token_ids_from_gguf(meta: Mapping[str, Any]) -> list[int]:
    """The ids that end a turn: ``eos`` plus ``eot``/``eom`` where the file names them."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        idx = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(idx, int) and idx not in ids:
            ids.append(idx)
    return ids
