"""Greedy output and logprobs token-identical to HF transformers, for every family and
through every scheduling path: batching, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.hf_models import ARCH_CONFIGS, VOCAB, write_hf_checkpoint

MAX_NEW = 24
LOGPROB_ATOL = 2e-4


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB) for _ in range(40)]  # a common prefix for cache hits
    lengths = [1, 3, 17, 16, 33, 70, 5, 48]
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(2, VOCAB) for _ in range(k)] for k in (1, 9, 23)]
    return prompts


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full HF forwards; returns tokens and log-softmax rows."""
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            row = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            tok = int(row.argmax())
            tokens.append(tok)
            logprobs.append(row)
            ids.append(tok)
    return tokens, logprobs


@pytest.fixture(scope="module", params=sorted(ARCH_CONFIGS))
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = write_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt",
                               tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = [_hf_greedy(hf, p) for p in _prompts()]
    return path, reference


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)

ENGINE_VARIANTS = {
    "batched": dict(),
    "chunked": dict(max_num_batched_tokens=24),
    "unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    "preempting": dict(num_blocks=14, block_size=8, max_num_batched_tokens=64),
}


def _assert_matches(outputs, reference) -> None:
    """Tokens identical, chosen and top-3 logprobs within LOGPROB_ATOL of transformers."""
    for out, (ref_tokens, ref_rows) in zip(outputs, reference):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"prompt of {len(out.prompt_token_ids)} tokens"
        for lp, row in zip(comp.logprobs, ref_rows):
            assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=LOGPROB_ATOL)
            ref_top = row.topk(3)
            assert [t for t, _ in lp.top] == ref_top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(ref_top.values.tolist(), abs=LOGPROB_ATOL)


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_greedy_matches_transformers(checkpoint, variant):
    path, reference = checkpoint
    llm = LLM(str(path), **ENGINE_VARIANTS[variant])
    _assert_matches(llm.generate(_prompts(), GREEDY), reference)
    if variant == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool should force preemption"
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_long_prompts_match_transformers(checkpoint):
    """Decode rows past 256 keys attend in key chunks merged after (a lone row's chunks on
    every thread): transformers' tokens and logprobs still, batched and alone."""
    from transformers import AutoModelForCausalLM

    path, _ = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (280, 460)]  # 2 and 2-3 chunks
    reference = [_hf_greedy(hf, p) for p in prompts]
    llm = LLM(str(path))
    _assert_matches(llm.generate(prompts, GREEDY), reference)
    _assert_matches(llm.generate(prompts[1:], GREEDY), reference[1:])


def test_prefix_cache_hits_keep_outputs_identical(checkpoint):
    path, reference = checkpoint
    llm = LLM(str(path))
    prompts = _prompts()
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)  # every full prompt block is now cached
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)
    assert any(o.num_cached_tokens >= 32 for o in second)
    for a, b, (ref_tokens, _) in zip(first, second, reference):
        assert a.outputs[0].token_ids == ref_tokens
        assert b.outputs[0].token_ids == ref_tokens


@pytest.mark.parametrize("switches", [dict(onednn=False), dict(cpu_kernels=False),
                                      dict(onednn=False, cpu_kernels=False)],
                         ids=["mkl-matmuls", "torch-attention-and-ops", "pure-torch"])
def test_fast_paths_off_match_too(checkpoint, switches):
    """oneDNN and the native CPU kernels switched off (the portable torch path a GPU
    runs): the same tokens, the same logprobs."""
    path, reference = checkpoint
    _assert_matches(LLM(str(path), **switches).generate(_prompts(), GREEDY), reference)
