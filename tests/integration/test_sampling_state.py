"""Sampling state travels with the request: a seeded, penalised request gives the same
tokens on one engine, across a prefill -> decode hand-off, and when it is re-driven
mid-stream on another engine that only gets the prompt and the tokens so far."""

from __future__ import annotations

import pytest

from tandem.common.config import CacheConfig, EngineConfig, EngineRole, SchedulerConfig
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine.engine import LLMEngine

BS = 4
PROMPT = [7, 19, 3, 88, 41, 5, 5, 60, 2, 13, 77]
SAMPLED = [
    SamplingParams(temperature=1.0, seed=123, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=7, max_tokens=24,
                   ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.4,
                   repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=2**63 - 1, max_tokens=24, min_tokens=20),
]


def _engine(path, role: EngineRole = EngineRole.BOTH, num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(block_size=BS, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(role=role)))


def _run(eng: LLMEngine, rid: str, params: SamplingParams, done: list[int] | None = None,
         others: int = 0) -> tuple[list[int], FinishReason]:
    """Run ``rid`` to the end (with ``others`` unseeded requests beside it)."""
    eng.add_request(rid, PROMPT, params, output_token_ids=done or ())
    for i in range(others):
        eng.add_request(f"{rid}-other{i}", PROMPT[i:] + [i], SamplingParams(temperature=1.0, max_tokens=30))
    toks, reason = list(done or ()), None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                reason = o.finish_reason if o.finished else reason
    assert eng.block_pool.num_free == eng.block_pool.num_blocks
    return toks, reason


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return (_engine(tiny_model_dir), _engine(tiny_model_dir),
            _engine(tiny_model_dir, EngineRole.PREFILL), _engine(tiny_model_dir, EngineRole.DECODE))


@pytest.mark.parametrize("params", SAMPLED, ids=["seed", "masks+penalties", "min_tokens"])
def test_redrive_continues_the_same_output(engines, params):
    a, b, _, _ = engines
    whole, reason = _run(a, "whole", params, others=3)
    assert len(whole) == 24 and reason is FinishReason.LENGTH
    assert _run(a, "again", params)[0] == whole  # alone or in a batch
    for k in (1, 5, 17):
        got, reason = _run(b, f"redrive{k}", params, done=whole[:k])
        assert got == whole, k
        assert reason is FinishReason.LENGTH


@pytest.mark.parametrize("params", SAMPLED, ids=["seed", "masks+penalties", "min_tokens"])
def test_prefill_decode_handoff_continues_the_same_output(engines, params):
    a, _, P, D = engines
    whole, _ = _run(a, "ref", params)
    blocks = D.reserve("pd", PROMPT, params)
    P.add_request("pd", PROMPT, params)
    first = None
    while first is None:
        first = next((o for o in P.step() if o.new_token_ids), None)
    p_blocks = P.prefilled_blocks("pd")
    D.import_kv(blocks, range(P.model_config.num_layers),
                P.export_kv(p_blocks, range(P.model_config.num_layers)))
    P.release("pd")
    toks = D.commit_imported("pd", first.new_token_ids[0]).new_token_ids
    while D.has_unfinished():
        for o in D.step():
            toks += o.new_token_ids
    assert toks == whole
    assert D.block_pool.num_free == D.block_pool.num_blocks


def test_redrive_past_max_tokens_is_refused(engines):
    a = engines[0]
    with pytest.raises(ValueError, match="max_tokens"):
        a.add_request("over", PROMPT, SamplingParams(max_tokens=3), output_token_ids=[1, 2, 3])
    assert not a.has_unfinished()
