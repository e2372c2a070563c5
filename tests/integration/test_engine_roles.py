"""Prefill- and decode-role engines and their KV hooks, driven by hand (no transport):
P prefills and holds, D reserves, P's KV is gathered and scattered into D's blocks
(whole, or layer group by layer group), D commits token #1 and decodes to the end.
The joined token list must equal a BOTH-role engine's greedy output, and every block
must come back on both sides."""

from __future__ import annotations

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig, EngineRole, SchedulerConfig
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache.kv_manager import blocks_needed

BS = 16
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _engine(path, role: EngineRole, num_blocks: int = 64, prefix_caching: bool = True,
            **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path),
        cache=CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(role=role, **sched)))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy tokens of a BOTH-role engine, one prompt at a time, no prefix cache."""
    eng = _engine(tiny_model_dir, EngineRole.BOTH, prefix_caching=False)
    memo: dict[tuple, list[int]] = {}

    def run(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(prompt), params)
        if key not in memo:
            eng.add_request("ref", prompt, params)
            toks: list[int] = []
            while eng.has_unfinished():
                for o in eng.step():
                    toks += o.new_token_ids
            assert eng.block_pool.num_free == eng.block_pool.num_blocks
            memo[key] = toks
        return memo[key]

    return run


@pytest.fixture(scope="module")
def pd(tiny_model_dir):
    return _engine(tiny_model_dir, EngineRole.PREFILL), _engine(tiny_model_dir, EngineRole.DECODE)


@pytest.fixture(autouse=True)
def _check_pools_after(request):
    """After each test using the shared P/D pair: all blocks back; clean up leftovers of a
    failed test so that it does not cascade into the next ones."""
    yield
    if "pd" not in request.fixturenames:
        return
    leaks = []
    for eng in request.getfixturevalue("pd"):
        try:
            assert_all_free(eng)
        except AssertionError as e:
            leaks.append(f"{eng.scheduler.role.value}: {e}")
            for rid in list(eng.scheduler.seqs):
                eng.abort(rid)
            for rid in list(eng._reserved):
                eng.cancel_reserved(rid)
    assert not leaks, leaks


def assert_all_free(eng: LLMEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.scheduler.seqs == {} and eng.scheduler.prefilled == {}
    assert eng._reserved == {}
    assert eng.block_pool.num_free == eng.block_pool.num_blocks
    eng.block_pool.check_invariants()


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt + 5) % 1000 + 3 for i in range(n)]


def prefill(P: LLMEngine, rid: str, prompt: list[int], params=GREEDY):
    """Queue on P and step until P returns token #1 for ``rid``."""
    P.add_request(rid, prompt, params)
    for _ in range(50):
        outs = [o for o in P.step() if o.request_id == rid]
        if outs:
            assert len(outs) == 1 and len(outs[0].new_token_ids) == 1
            return outs[0]
    raise AssertionError("prefill never produced token #1")


def decode_to_end(D: LLMEngine, rid: str) -> tuple[list[int], FinishReason]:
    toks, reason = [], None
    while D.has_unfinished():
        for o in D.step():
            assert o.request_id == rid
            toks += o.new_token_ids
            if o.finished:
                reason = o.finish_reason
    return toks, reason


GROUPINGS = {
    "whole": lambda n: [range(0, n)],
    "two-groups": lambda n: [range(0, 1), range(1, n)],
    "per-layer": lambda n: [range(i, i + 1) for i in range(n)],
}


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("prompt_len", [1, 7, 16, 32, 37])
def test_disaggregated_equals_colocated(pd, reference, prompt_len, grouping):
    P, D = pd
    prompt = _prompt(prompt_len, salt=prompt_len)
    expected = reference(prompt)
    assert len(expected) == MAX_NEW
    n_layers = P.model_config.num_layers
    nb = blocks_needed(prompt_len, BS)

    # decode is chosen first: it reserves the prompt's blocks before P computes
    d_blocks = D.reserve("req", prompt, GREEDY)
    assert d_blocks is not None and len(d_blocks) == nb
    assert D.block_pool.num_free == D.block_pool.num_blocks - nb
    assert not D.has_unfinished()  # reserved, not scheduled

    first = prefill(P, "req", prompt)
    assert first.new_token_ids == [expected[0]]
    assert not first.finished and first.finish_reason is None
    assert first.num_prompt_tokens == prompt_len and first.num_output_tokens == 1
    assert not P.has_unfinished()  # held, not running
    p_blocks = P.prefilled_blocks("req")
    assert len(p_blocks) == nb

    for layers in GROUPINGS[grouping](n_layers):
        data = P.export_kv(p_blocks, layers)
        assert tuple(data.shape) == P.kv_cache.block_shape(nb, layers)
        D.import_kv(d_blocks, layers, data)
    full = P.export_kv(p_blocks, range(0, n_layers))
    assert torch.equal(D.export_kv(d_blocks, range(0, n_layers)), full)

    committed = D.commit_imported("req", first.new_token_ids[0])
    assert committed.new_token_ids == [expected[0]] and not committed.finished
    rest, reason = decode_to_end(D, "req")
    assert [expected[0]] + rest == expected
    assert reason == FinishReason.LENGTH

    P.release("req")
    assert P.block_pool.num_free == P.block_pool.num_blocks
    with pytest.raises(KeyError):
        P.prefilled_blocks("req")
    P.release("req")  # releasing twice is harmless


def test_several_requests_in_flight(pd, reference):
    """Three prompts prefilled in one P step; D reserves in another order (other block ids)
    and joins them to its decode batch one at a time, mid-stream."""
    P, D = pd
    prompts = {"a": _prompt(5, 1), "b": _prompt(16, 2), "c": _prompt(33, 3)}
    expected = {rid: reference(p) for rid, p in prompts.items()}
    d_blocks = {rid: D.reserve(rid, prompts[rid], GREEDY) for rid in ("c", "a", "b")}
    for rid, p in prompts.items():
        P.add_request(rid, p, GREEDY)
    outs = P.step()  # all three fit one step's budget
    first = {o.request_id: o.new_token_ids[0] for o in outs}
    assert first == {rid: e[0] for rid, e in expected.items()}
    assert set(P.scheduler.prefilled) == {"a", "b", "c"}

    got = {rid: [] for rid in prompts}
    reasons = {}
    for rid in ("b", "a", "c"):
        blocks = P.prefilled_blocks(rid)
        D.import_kv(d_blocks[rid], range(0, 1), P.export_kv(blocks, range(0, 1)))
        D.import_kv(d_blocks[rid], range(1, P.model_config.num_layers),
                    P.export_kv(blocks, range(1, P.model_config.num_layers)))
        P.release(rid)
        got[rid] += D.commit_imported(rid, first[rid]).new_token_ids
        for _ in range(2):  # the others keep decoding while the next request arrives
            for o in D.step():
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
    while D.has_unfinished():
        for o in D.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert got == expected
    assert reasons == {rid: FinishReason.LENGTH for rid in prompts}


def test_prefix_hit_on_prefill_side_still_exports_the_full_prompt(pd, reference):
    P, D = pd
    prompt = _prompt(40, 9)
    expected = reference(prompt)
    for attempt, rid in enumerate(("warm", "hit")):
        d_blocks = D.reserve(rid, prompt, GREEDY)
        first = prefill(P, rid, prompt)
        assert first.num_cached_tokens == (0 if attempt == 0 else 32)
        n = P.model_config.num_layers
        D.import_kv(d_blocks, range(0, n), P.export_kv(P.prefilled_blocks(rid), range(0, n)))
        P.release(rid)
        toks = D.commit_imported(rid, first.new_token_ids[0]).new_token_ids
        toks += decode_to_end(D, rid)[0]
        assert toks == expected, rid


def test_layerwise_export_during_the_prefill_step(pd, reference):
    """``on_layer_done(i)`` fires after layer i wrote its KV: exporting it right there gives
    exactly what a later full export gives, and is enough for D."""
    P, D = pd
    prompt = _prompt(37, 4)
    expected = reference(prompt)
    n = P.model_config.num_layers
    d_blocks = D.reserve("lw", prompt, GREEDY)
    P.add_request("lw", prompt, GREEDY)
    chunks: dict[int, torch.Tensor] = {}

    def on_layer_done(i: int, *completing) -> None:
        # engines that pass the sequences completing this step: it is exactly ours
        if completing:
            assert [s.seq_id for s in completing[0]] == ["lw"]
        seq = P.scheduler.get("lw")
        chunks[i] = P.export_kv(seq.block_ids, range(i, i + 1))

    outs = P.step(on_layer_done)
    assert sorted(chunks) == list(range(n))
    first = outs[0].new_token_ids[0]
    blocks = P.prefilled_blocks("lw")
    for i in range(n):
        assert torch.equal(chunks[i], P.export_kv(blocks, range(i, i + 1)))
        D.import_kv(d_blocks, range(i, i + 1), chunks[i])
    P.release("lw")
    toks = D.commit_imported("lw", first).new_token_ids + decode_to_end(D, "lw")[0]
    assert toks == expected


def test_export_into_a_preallocated_buffer(pd):
    P, D = pd
    prompt = _prompt(20, 5)
    prefill(P, "buf", prompt)
    blocks = P.prefilled_blocks("buf")
    layers = range(1, P.model_config.num_layers)
    out = torch.empty(P.kv_cache.block_shape(len(blocks), layers), dtype=P.dtype)
    assert P.export_kv(blocks, layers, out=out) is out
    assert torch.equal(out, P.export_kv(blocks, layers))
    assert out.abs().sum() > 0  # real KV, not the zero-initialised cache
    P.release("buf")


def test_release_abort_and_cancel_free_everything(pd):
    P, D = pd
    prompt = _prompt(33, 6)
    nb = blocks_needed(33, BS)
    prefill(P, "held", prompt)
    assert P.block_pool.num_free == P.block_pool.num_blocks - nb
    P.release("held")
    assert P.block_pool.num_free == P.block_pool.num_blocks

    prefill(P, "held2", prompt)
    out = P.abort("held2")  # a held request can be aborted as well
    assert out is not None and out.finish_reason == FinishReason.ABORT and out.finished
    assert P.abort("held2") is None
    assert P.block_pool.num_free == P.block_pool.num_blocks

    blocks = D.reserve("res", prompt, GREEDY)
    assert len(blocks) == nb and D.block_pool.num_free == D.block_pool.num_blocks - nb
    with pytest.raises(ValueError, match="already in use"):
        D.reserve("res", prompt, GREEDY)
    assert D.cancel_reserved("res") is True
    assert D.cancel_reserved("res") is False
    assert D.cancel_reserved("never-reserved") is False
    assert D.block_pool.num_free == D.block_pool.num_blocks
    assert D.reserve("res", prompt, GREEDY) is not None  # the id is free again
    assert D.cancel_reserved("res")


def test_reserve_returns_none_when_the_pool_is_full(tiny_model_dir):
    D = _engine(tiny_model_dir, EngineRole.DECODE, num_blocks=4)
    assert D.reserve("big", _prompt(40), GREEDY) is not None  # 3 of 4 blocks
    assert D.reserve("next", _prompt(20), GREEDY) is None  # needs 2
    assert D.block_pool.num_free == 1
    assert D.cancel_reserved("next") is False  # a refused reservation holds nothing
    assert D.reserve("small", _prompt(10), GREEDY) is not None
    assert D.block_pool.num_free == 0
    with pytest.raises(ValueError, match="empty"):
        D.reserve("bad", [], GREEDY)
    assert D.cancel_reserved("big") and D.cancel_reserved("small")
    assert_all_free(D)


def test_request_ending_at_token_one(pd, reference):
    """max_tokens=1: P reports ``length`` with token #1 (its KV may still be held for
    export; release frees it). D commits token #1 and finishes at once (length, or stop
    when it is a stop token id), freeing its reservation."""
    P, D = pd
    prompt = _prompt(18, 7)
    tok1 = reference(prompt)[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    first = prefill(P, "one", prompt, one)
    assert first.new_token_ids == [tok1]
    assert first.finish_reason == FinishReason.LENGTH
    assert not P.has_unfinished()
    P.release("one")
    assert P.block_pool.num_free == P.block_pool.num_blocks
    with pytest.raises(KeyError):
        P.prefilled_blocks("one")

    for rid, params, reason in (("len", one, FinishReason.LENGTH),
                                ("stop", SamplingParams(temperature=0.0, stop_token_ids=[tok1]),
                                 FinishReason.STOP)):
        D.reserve(rid, prompt, params)
        out = D.commit_imported(rid, tok1)
        assert out.finished and out.finish_reason == reason and out.new_token_ids == [tok1]
        assert not D.has_unfinished()
        assert D.block_pool.num_free == D.block_pool.num_blocks


def test_abort_frees_a_reservation(tiny_model_dir):
    D = _engine(tiny_model_dir, EngineRole.DECODE, num_blocks=8)
    assert D.reserve("r", _prompt(20), GREEDY) is not None
    out = D.abort("r")
    assert D.block_pool.num_free == D.block_pool.num_blocks
    assert out is not None and out.finish_reason == FinishReason.ABORT


def test_add_request_refuses_an_id_that_is_reserved(tiny_model_dir):
    D = _engine(tiny_model_dir, EngineRole.DECODE, num_blocks=8)
    D.reserve("r", _prompt(20), GREEDY)
    try:
        with pytest.raises(ValueError, match="already in use"):
            D.add_request("r", _prompt(5), GREEDY)
    finally:
        D.cancel_reserved("r")


def test_the_load_snapshot_carries_the_rate_prompt_steps_ran_at(tiny_model_dir):
    """The rate the router weighs prefill backlogs by: measured on prompt steps only."""
    eng = _engine(tiny_model_dir, EngineRole.BOTH, max_num_batched_tokens=32)
    assert eng.load_snapshot()["prefill_tokens_per_s"] == 0.0
    eng.add_request("r", list(range(1, 81)), GREEDY)
    eng.step()  # 32 of 80 prompt tokens
    first = eng.load_snapshot()["prefill_tokens_per_s"]
    assert first > 0.0
    while eng.scheduler.get("r").num_uncomputed_tokens > 1:
        eng.step()
    after_prompt = eng.load_snapshot()["prefill_tokens_per_s"]
    while eng.has_unfinished():
        eng.step()  # decode steps leave it alone
    assert eng.load_snapshot()["prefill_tokens_per_s"] == after_prompt
