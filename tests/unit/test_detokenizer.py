"""IncrementalDetokenizer: UTF-8 safety, stop strings, and the decode() invariant."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from tandem.engine.default_model import corpus, write_model
from tandem.text.detokenizer import IncrementalDetokenizer
from tandem.text.tokenizer import Tokenizer

MULTIBYTE = "héllo wörld 日本語 🎉"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_model("tiny", tmp_path_factory.mktemp("detok") / "tiny"))


@pytest.fixture(scope="module")
def window_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The same tokenizer, but forced onto the decode-a-window fallback path."""
    t = Tokenizer.from_dir(write_model("tiny", tmp_path_factory.mktemp("detok2") / "tiny"))
    t.is_byte_level = False
    return t


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """A Llama-2-style tokenizer (metaspace, byte fallback): not byte-level."""
    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
                                  show_progress=False)
    hf.train_from_iterator(corpus()[:200], trainer=trainer)
    data = json.loads(hf.to_str())
    vocab = data["model"]["vocab"]  # put the <0xXX> byte tokens into the model vocab after the specials
    rest = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in ("<unk>", "<s>", "</s>")]
    order = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *rest]
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    data["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ]).__getstate__())
    return Tokenizer(HFTokenizer.from_str(json.dumps(data)), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def _byte_ids(tok: Tokenizer) -> dict[int, int]:
    """byte value -> id of the token that is exactly that byte."""
    out = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b is not None and len(b) == 1:
            out[b[0]] = i
    return out


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    chunks, stopped = [], False
    for i in ids:
        text, stopped = detok.add(i)
        chunks.append(text)
        if stopped:
            break
    return chunks, stopped


def test_multibyte_split_across_tokens(tok: Tokenizer) -> None:
    byte_ids = _byte_ids(tok)
    ids = [byte_ids[b] for b in MULTIBYTE.encode()]  # one token per byte: every multibyte char is split
    detok = IncrementalDetokenizer(tok)
    chunks, stopped = _stream(detok, ids)
    assert not stopped
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == MULTIBYTE and detok.flush() == "" and detok.text == MULTIBYTE
    assert chunks[-4:] == ["", "", "", "🎉"]  # held until the 4th byte arrives


def test_incomplete_and_invalid_bytes(tok: Tokenizer) -> None:
    byte_ids = _byte_ids(tok)
    detok = IncrementalDetokenizer(tok)
    assert detok.add(byte_ids[0xE6]) == ("", False)  # held: start of a 3-byte char
    assert detok.add(byte_ids[ord("a")]) == ("\ufffda", False)  # definitely invalid: replaced at once
    assert detok.add(byte_ids[0xF0]) == ("", False)
    assert detok.flush() == "\ufffd"  # incomplete at the end
    assert detok.text == tok.decode([byte_ids[0xE6], byte_ids[ord("a")], byte_ids[0xF0]])


@pytest.mark.parametrize("which", ["tok", "window_tok"])
@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_match_decode(which: str, skip: bool, request: pytest.FixtureRequest) -> None:
    t: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(f"{which}-{skip}")
    byte_ids = list(_byte_ids(request.getfixturevalue("tok")).values())
    for n in range(300):
        pool = byte_ids if n % 3 == 0 else range(t.vocab_size)  # byte-only streams split chars often
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 24))]
        if n % 5 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(sorted(t.all_special_ids)))
        detok = IncrementalDetokenizer(t, skip_special_tokens=skip)
        chunks, stopped = _stream(detok, ids)
        out = "".join(chunks) + detok.flush()
        assert not stopped
        assert out == t.decode(ids, skip_special_tokens=skip), ids
        assert detok.text == out


def test_encoded_text_roundtrip_streams(tok: Tokenizer, window_tok: Tokenizer, sp_tok: Tokenizer) -> None:
    texts = [MULTIBYTE, "Hello world, the model returns a token.", "  spaces  and\nnew lines ", "日本語のテキスト 🎉🚀"]
    for t in (tok, window_tok, sp_tok):
        for text in texts:
            ids = t.encode(text, add_special_tokens=False)
            detok = IncrementalDetokenizer(t)
            chunks, _ = _stream(detok, ids)
            assert all("\ufffd" not in c for c in chunks)
            assert "".join(chunks) + detok.flush() == t.decode(ids)
    # sp-style: CJK/emoji not in vocab, so they are split into <0xXX> byte tokens
    ids = sp_tok.encode("日本 🎉", add_special_tokens=False)
    assert sum(sp_tok.id_to_token(i).startswith("<0x") for i in ids) >= 7


def test_out_of_vocab_ids_contribute_nothing(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)  # the bench preset's model vocab exceeds the tokenizer's
    assert detok.add(tok.vocab_size + 5) == ("", False)
    assert detok.add(tok.encode("hi")[0])[0] == "h"


def test_special_tokens(tok: Tokenizer) -> None:
    im_end = tok.backend.token_to_id("<|im_end|>")
    ids = tok.encode("hi") + [im_end]
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)[0]) == "hi"
    assert "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)[0]) == "hi<|im_end|>"


def _char_ids(tok: Tokenizer, text: str) -> list[int]:
    byte_ids = _byte_ids(tok)
    return [byte_ids[b] for b in text.encode()]


def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    text = "say wörld now"
    for ids in (_char_ids(tok, text), tok.encode(text)):
        detok = IncrementalDetokenizer(tok, stop=["wörld"])
        chunks, stopped = _stream(detok, ids)
        assert stopped and detok.stopped and detok.matched_stop == "wörld"
        assert "".join(chunks) == "say " == detok.text
        assert detok.add(ids[-1]) == ("", True)  # ignored after the stop
        assert detok.flush() == ""
    # the stop fires on the token that completes it, not later
    ids = _char_ids(tok, text)
    detok = IncrementalDetokenizer(tok, stop=["wörld"])
    chunks, _ = _stream(detok, ids)
    assert len(chunks) == len("say wörld".encode())


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["wörld"], include_stop_str_in_output=True)
    chunks, stopped = _stream(detok, tok.encode("héllo wörld 日本語"))
    assert stopped and "".join(chunks) == "héllo wörld"


def test_held_prefix_released_when_it_stops_matching(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["abc"])
    ids = _char_ids(tok, "xabd")
    assert detok.add(ids[0]) == ("x", False)
    assert detok.add(ids[1]) == ("", False)  # "a" may start "abc"
    assert detok.add(ids[2]) == ("", False)  # "ab" too
    assert detok.add(ids[3]) == ("abd", False)  # "abd" cannot
    detok2 = IncrementalDetokenizer(tok, stop=["abc"])
    _stream(detok2, _char_ids(tok, "zab"))
    assert detok2.text == "z" and detok2.flush() == "ab" and detok2.text == "zab"


def test_stop_overlaps_and_priority(tok: Tokenizer) -> None:
    # "aab": held "aa" must still find "aab" (overlapping prefix restarts)
    detok = IncrementalDetokenizer(tok, stop=["aab"])
    chunks, stopped = _stream(detok, _char_ids(tok, "xaaab"))
    assert stopped and "".join(chunks) == "xa"
    # several stops: the one that completes first wins
    detok = IncrementalDetokenizer(tok, stop=["abcd", "bc"])
    assert "".join(_stream(detok, _char_ids(tok, "abcd"))[0]) == "a" and detok.matched_stop == "bc"
    detok = IncrementalDetokenizer(tok, stop=["bc", "abcd"], include_stop_str_in_output=True)
    assert "".join(_stream(detok, tok.encode("zabcd"))[0]) == "zabc"


def test_stop_strings_random(tok: Tokenizer) -> None:
    rng = random.Random(7)
    words = ["ab", "b", "c", "é", "日", "🎉", " ", "abc", "x"]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        stops = ["".join(rng.choice(words) for _ in range(rng.randint(1, 2))) for _ in range(rng.randint(1, 3))]
        ids = _char_ids(tok, text) if rng.random() < 0.5 else tok.encode(text)
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)
        chunks, stopped = _stream(detok, ids)
        out = "".join(chunks) + detok.flush()
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if not hits:
            assert not stopped and out == text
            continue
        end, start, _ = min(hits)
        assert stopped and out == (text[:end] if include else text[:start]), (text, stops)


def test_fallback_path_stop_strings(sp_tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(sp_tok, stop=["日本"])
    chunks, stopped = _stream(detok, sp_tok.encode("model 日本 🎉", add_special_tokens=False))
    assert stopped and "".join(chunks) == "model "


def test_bad_stop_strings(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=[""])
    detok = IncrementalDetokenizer(tok, stop="x")  # a bare string is one stop string
    assert _stream(detok, tok.encode("ax"))[1]


def test_add_after_flush_raises(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    detok.add(tok.encode("a")[0])
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add(tok.encode("a")[0])
