"""Tokenizers rebuilt from GGUF metadata agree with transformers' reading of the same metadata
(a SentencePiece vocabulary here; the byte-level one is checked on the real model and on a
GGUF of the tiny preset); unsupported vocabularies are named."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.engine.default_model import corpus
from tandem.text.gguf_tokenizer import tokenizer_from_gguf

TEXTS = ["Hello world, the model 1234!", "  two leading spaces", "def f(x):\n    return x",
         "héllo wörld 🎉 日本語", "tab\tand trailing "]


@pytest.fixture(scope="module")
def sp_meta() -> dict:
    """SentencePiece-style metadata: <unk> <s> </s>, 256 byte tokens, then BPE pieces by score."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>"],
                                                          show_progress=False))
    pieces = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]) if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}


def test_sentencepiece_matches_transformers(sp_meta):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    ours, config = tokenizer_from_gguf(sp_meta)
    hf_dict = {"tokenizer_type": "llama", "tokens": sp_meta["tokenizer.ggml.tokens"],
               "scores": sp_meta["tokenizer.ggml.scores"], "token_type": sp_meta["tokenizer.ggml.token_type"],
               "unk_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    theirs, _ = convert_gguf_tokenizer("llama", hf_dict)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids).strip() == text.strip()
    assert any(3 <= i < 259 for i in ours.encode("🙂", add_special_tokens=False).ids)  # byte fallback
    assert ours.encode("hi").ids[0] == 1 and config["add_bos_token"]  # llama.cpp's default for SentencePiece
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")


def test_unsupported_vocabularies_are_named(sp_meta):
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 't5'"):
        tokenizer_from_gguf({**sp_meta, "tokenizer.ggml.model": "t5"})
    with pytest.raises(ValueError, match="no tokenizer.ggml.scores"):
        tokenizer_from_gguf({k: v for k, v in sp_meta.items() if k != "tokenizer.ggml.scores"})
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'exotic'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                             "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "exotic"})
