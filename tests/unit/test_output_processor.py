"""OutputProcessor: the one place that turns engine tokens into user-visible output."""

from __future__ import annotations

import pytest

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine.default_model import write_model
from tandem.text.output_processor import OutputProcessor
from tandem.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_model("tiny", tmp_path_factory.mktemp("outproc") / "tiny"))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok: Tokenizer, params: SamplingParams, tokens: list[int], reason: FinishReason | None,
        chunk: int = 1):
    """Feed ``tokens`` in chunks, the engine's ``reason`` on the last; (text, tokens, reason, by_text)."""
    proc = OutputProcessor(tok, params)
    text, used, by_text = "", [], False
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        last = start + chunk >= len(tokens)
        d = proc.process(part, reason if last else None, [float(t) for t in part])
        text += d.text
        used += d.token_ids
        assert d.logprobs == tuple(float(t) for t in d.token_ids)
        by_text |= d.stopped_by_text
        if d.finished:
            break
    return text, used, proc.finish_reason, by_text


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_plain_text_and_engine_reason(tok, chunk):
    toks = ids(tok, "hello world, again")
    text, used, reason, by_text = run(tok, SamplingParams(), toks, FinishReason.LENGTH, chunk)
    assert text == tok.decode(toks) and used == toks
    assert reason is FinishReason.LENGTH and not by_text


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_string_cuts_text_tokens_and_logprobs(tok, chunk):
    toks = ids(tok, "one two three four five")
    text, used, reason, by_text = run(tok, SamplingParams(stop=["three"]), toks, FinishReason.LENGTH, chunk)
    assert text == "one two " and reason is FinishReason.STOP and by_text
    assert tok.decode(used).startswith("one two three") and len(used) < len(toks)
    text, _, _, _ = run(tok, SamplingParams(stop=["three"], include_stop_str_in_output=True), toks,
                        FinishReason.LENGTH, chunk)
    assert text == "one two three"


def test_engine_stop_hides_the_stop_token_text(tok):
    toks = ids(tok, "abc def")
    eos = sorted(tok.eos_token_ids)[0]
    text, used, reason, _ = run(tok, SamplingParams(), toks + [eos], FinishReason.STOP)
    assert text == tok.decode(toks) and used == toks + [eos] and reason is FinishReason.STOP


def test_stop_strings_wait_for_min_tokens(tok):
    toks = ids(tok, "ab ab ab ab ab ab")
    n_first = len(ids(tok, "ab ab"))
    # The first stop match lies wholly after the first min_tokens tokens' text.
    text, _, reason, _ = run(tok, SamplingParams(stop=["ab"], min_tokens=n_first, max_tokens=50),
                             toks, FinishReason.LENGTH)
    assert text.startswith("ab ab") and reason is FinishReason.STOP
    assert not text.endswith("ab")


def test_abort_passes_through_without_flush(tok):
    proc = OutputProcessor(tok, SamplingParams(stop=["zzz"]))
    proc.process(ids(tok, "hello z"))
    d = proc.process((), FinishReason.ABORT)
    assert d.finish_reason is FinishReason.ABORT and d.text == ""
    with pytest.raises(RuntimeError):
        proc.process([1])
