"""Scheduler: token budget, chunked prefill, preemption, roles; no leak or deadlock under
any sequence of add/step/abort."""

from __future__ import annotations

import random

from tandem.common.config import EngineRole, SchedulerConfig
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine.kv_cache.block_pool import BlockPool
from tandem.engine.kv_cache.kv_manager import KVCacheManager
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, SequenceStatus


def _sched(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(BlockPool(num_blocks), block_size))


def _seq(i: int, n_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(f"r{i}", [100 + i] * n_prompt, SamplingParams(max_tokens=max_tokens))


def _step(s: Scheduler, finished: list[Sequence]) -> list:
    """One fake model step: advance cursors, append a token to sampling rows, finish at max."""
    out = s.schedule()
    finished += out.finished
    sampling = [it.seq for it in out.scheduled if it.samples]
    s.on_step_done(out)
    for seq in sampling:
        seq.output_token_ids.append(7)
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            s.finish(seq, FinishReason.LENGTH)
            finished.append(seq)
        elif s.role == EngineRole.PREFILL:
            s.hold_prefilled(seq)
    return out.scheduled


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    s = _sched(max_num_batched_tokens=10)
    s.add(_seq(0, 3, max_tokens=10))
    _step(s, [])  # r0 prefilled whole (3 tokens)
    s.add(_seq(1, 25))
    items = _step(s, [])
    assert [(i.seq.seq_id, i.num_new_tokens) for i in items] == [("r0", 1), ("r1", 9)]
    items = _step(s, [])
    assert [(i.seq.seq_id, i.num_new_tokens) for i in items] == [("r0", 1), ("r1", 9)]
    items = _step(s, [])
    assert [(i.seq.seq_id, i.num_new_tokens) for i in items] == [("r0", 1), ("r1", 7)]
    assert items[1].seq.output_token_ids == [7], "last chunk samples"


def test_a_step_counts_its_prompt_tokens_apart_from_its_decodes():
    """The engine's prompt rate divides these by the step's time."""
    s = _sched(max_num_batched_tokens=10)
    s.add(_seq(0, 3, max_tokens=10))
    out = s.schedule()
    assert out.num_prompt_tokens == 3  # a waiting prompt, admitted whole
    s.on_step_done(out)
    out.scheduled[0].seq.output_token_ids.append(7)
    s.add(_seq(1, 25))
    out = s.schedule()  # r0 decodes 1, r1 takes a 9-token chunk
    assert [i.num_new_tokens for i in out.scheduled] == [1, 9] and out.num_prompt_tokens == 9
    s.on_step_done(out)
    out.scheduled[0].seq.output_token_ids.append(7)
    out = s.schedule()  # r1 continues from the running list
    assert [i.num_new_tokens for i in out.scheduled] == [1, 9] and out.num_prompt_tokens == 9


def test_unchunked_prefill_waits_for_room():
    s = _sched(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(_seq(0, 6))
    s.add(_seq(1, 6))
    items = _step(s, [])
    assert [i.seq.seq_id for i in items] == ["r0"], "r1 does not fit the rest of the budget"


def test_preemption_when_blocks_run_out_then_everything_finishes():
    s = _sched(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        s.add(_seq(i, 7, max_tokens=9))  # each needs 4 blocks at the end; 6 exist
    finished: list[Sequence] = []
    for _ in range(200):
        if not s.has_work:
            break
        _step(s, finished)
    assert not s.has_work
    assert s.num_preemptions > 0
    assert sorted(f.seq_id for f in finished) == ["r0", "r1", "r2"]
    assert all(len(f.output_token_ids) == 9 for f in finished), "recompute keeps outputs"
    assert s.kv.pool.num_free == 6


def test_sequence_bigger_than_the_cache_finishes_with_length():
    s = _sched(num_blocks=3, block_size=4)
    s.add(_seq(0, 5, max_tokens=100))
    finished: list[Sequence] = []
    for _ in range(50):
        if not s.has_work:
            break
        _step(s, finished)
    assert finished[0].finish_reason == FinishReason.LENGTH
    assert finished[0].num_tokens == 12 + 1, "grew until the 3 blocks were full"
    assert s.kv.pool.num_free == 3


def test_max_num_seqs_caps_the_batch():
    s = _sched(max_num_seqs=2)
    for i in range(4):
        s.add(_seq(i, 2))
    assert len(_step(s, [])) == 2


def test_prefill_role_holds_kv_until_finished():
    s = _sched(role=EngineRole.PREFILL)
    s.add(_seq(0, 9))
    _step(s, [])
    seq = s.prefilled["r0"]
    assert seq.status == SequenceStatus.PREFILLED and seq.block_ids
    assert not s.has_work
    s.finish(seq, FinishReason.STOP)
    assert s.kv.pool.num_free == 64


def test_random_add_step_abort_never_leaks_or_deadlocks():
    rng = random.Random(3)
    s = _sched(num_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    finished: list[Sequence] = []
    added = 0
    for _ in range(3000):
        r = rng.random()
        if r < 0.2 and added < 300:
            s.add(_seq(added, rng.randrange(1, 30), max_tokens=rng.randrange(1, 20)))
            added += 1
        elif r < 0.25 and s.seqs:
            victim = s.seqs[rng.choice(sorted(s.seqs))]
            s.finish(victim, FinishReason.ABORT)
            finished.append(victim)
        else:
            _step(s, finished)
        s.kv.pool.check_invariants()
        held = sum(len(q.block_ids) for q in s.seqs.values())
        assert sum(s.kv.pool.ref_count(b) for b in range(20)) == held
    for _ in range(5000):
        if not s.has_work:
            break
        _step(s, finished)
    assert not s.has_work, "all work drains: no deadlock"
    assert len(finished) == added
    assert all(f.block_ids == [] for f in finished)
    assert s.kv.pool.num_free == 20


def test_a_reservation_holds_blocks_unscheduled_until_its_kv_is_admitted():
    s = _sched(num_blocks=8, block_size=4, role=EngineRole.DECODE)
    seq = _seq(0, 10)
    assert s.reserve(seq)
    assert seq.status == SequenceStatus.RESERVED and len(seq.block_ids) == 3
    assert s.get("r0") is seq and s.reserved == {"r0": seq}
    assert not s.has_work and s.schedule().scheduled == []  # nothing to compute yet
    with __import__("pytest").raises(ValueError, match="duplicate"):
        s.reserve(_seq(0, 4))
    admitted = s.admit_imported("r0")
    seq.output_token_ids.append(7)  # token #1 from the prefill worker
    assert admitted is seq and seq.status == SequenceStatus.RUNNING and seq.imported
    assert s.reserved == {} and seq.num_uncomputed_tokens == 1
    [item] = s.schedule().scheduled
    assert item.seq is seq and item.num_new_tokens == 1


def test_cancelling_or_finishing_a_reservation_frees_its_blocks_once():
    s = _sched(num_blocks=8, block_size=4, role=EngineRole.DECODE)
    a, b = _seq(0, 10), _seq(1, 10)
    assert s.reserve(a) and s.reserve(b)
    assert s.kv.pool.num_free == 2
    assert not s.reserve(_seq(2, 10)) and s.kv.pool.num_free == 2  # refused: holds nothing
    assert s.cancel_reservation("r0") and not s.cancel_reservation("r0")
    s.finish(b, FinishReason.ABORT)
    assert b.status == SequenceStatus.RELEASED and s.seqs == {} and s.reserved == {}
    assert s.kv.pool.num_free == 8
    with __import__("pytest").raises(KeyError):
        s.admit_imported("r1")
