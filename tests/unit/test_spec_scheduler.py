"""Scheduling k + 1 positions for a speculating sequence and rolling back its KV."""

from __future__ import annotations

from tandem.common.config import SchedulerConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.kv_cache.block_pool import BlockPool
from tandem.engine.kv_cache.kv_manager import KVCacheManager
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence


def _decoding(s: Scheduler, seq_id: str, n_prompt: int) -> Sequence:
    """A running sequence with its prompt computed and one output token to decode."""
    seq = Sequence(seq_id, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=50),
                   output_token_ids=[1])
    assert s.reserve(seq)  # as an imported sequence: prompt KV in place, then admitted
    s.admit_imported(seq_id)
    return seq


def test_drafts_ride_on_decodes_within_budget_and_blocks():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8),
                  KVCacheManager(BlockPool(64), 4))
    a, b = _decoding(s, "a", 6), _decoding(s, "b", 3)
    out = s.schedule({"a": [5, 6, 7, 8], "b": [9, 9, 9, 9]})
    items = {it.seq.seq_id: it for it in out.scheduled}
    assert items["a"].draft_token_ids == [5, 6, 7, 8] and items["a"].num_scheduled_tokens == 5
    assert items["b"].draft_token_ids == [9, 9] and out.num_batched_tokens == 8  # budget cut
    assert len(a.block_ids) == 3  # positions 0..10 of a: 7 tokens + 4 drafts


def test_a_draft_never_preempts():
    s = Scheduler(SchedulerConfig(), KVCacheManager(BlockPool(4), 4))
    a, b = _decoding(s, "a", 5), _decoding(s, "b", 5)  # 2 blocks each: the pool is full
    out = s.schedule({"a": [1, 2, 3]})  # a's draft needs a third block: none is free
    assert out.preempted == [] and [it.seq for it in out.scheduled] == [a, b]
    assert all(it.draft_token_ids == [] and it.num_new_tokens == 1 for it in out.scheduled)


def test_commit_keeps_accepted_kv_and_frees_surplus_blocks():
    pool = BlockPool(64)
    s = Scheduler(SchedulerConfig(), KVCacheManager(pool, 4))
    seq = _decoding(s, "a", 7)  # 8 tokens, 7 computed
    out = s.schedule({"a": [3, 4, 5, 6, 7, 8]})
    assert len(seq.block_ids) == 4  # positions 0..13
    s.on_step_done(out)
    assert seq.num_computed_tokens == 8
    seq.output_token_ids += [3, 99]  # one draft accepted, then the correction
    s.commit_draft(seq, 1)
    assert seq.num_computed_tokens == 9 and seq.num_tokens == 10
    assert len(seq.block_ids) == 3  # 10 tokens need 3 blocks; the fourth went back
    assert pool.num_free == 64 - 3
    assert len(seq.block_hashes) == 2  # only blocks full of computed tokens are published
