"""Block pool: allocation, reference counts, LRU prefix cache, no leaks or double frees."""

from __future__ import annotations

import random

import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.common.block_hash import hash_block
from tandem.engine.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from tandem.engine.kv_cache.kv_manager import KVCacheManager
from tandem.engine.sequence import Sequence


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1, "a failed allocation takes nothing"
    pool.free(a)
    assert pool.num_free == 4
    pool.check_invariants()


def test_double_free_is_refused():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_hash_chains_on_parent():
    h1 = hash_block(None, [1, 2, 3])
    assert h1 == hash_block(None, [1, 2, 3])
    assert hash_block(h1, [4]) != hash_block(None, [4])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_freed_cached_block_is_revived_then_evicted_lru():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register(a, b"A")
    pool.free([c, b, a])  # LRU order: c, b, a
    assert pool.lookup(b"A") == a
    pool.acquire(a)  # revived from the free queue
    assert pool.ref_count(a) == 1 and pool.num_free == 2
    pool.free([a])  # back at the LRU tail
    assert pool.allocate(2) == sorted([c, b])  # the two least recently freed, ascending
    assert pool.lookup(b"A") == a, "still cached: not yet handed out"
    assert pool.allocate(1) == [a]
    assert pool.lookup(b"A") is None, "handed out again: hash evicted"
    pool.check_invariants()


def test_prefix_caching_off_never_hits():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    pool.register(a, b"A")
    assert pool.lookup(b"A") is None


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(f"s{i}", tokens, SamplingParams())


def test_match_prefix_leaves_one_token_to_compute():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    first = _seq(0, list(range(8)))
    assert kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.cache_full_blocks(first)
    same = _seq(1, list(range(8)))
    assert kv.match_prefix(same) == 4, "the last block is recomputed for its logits"
    longer = _seq(2, list(range(9)))
    assert kv.match_prefix(longer) == 8
    assert longer.block_ids == first.block_ids
    assert kv.pool.ref_count(first.block_ids[0]) == 3
    for s in (first, same, longer):
        kv.free(s)
    assert kv.pool.num_free == 8
    kv.pool.check_invariants()


def test_random_workload_never_leaks():
    rng = random.Random(7)
    kv = KVCacheManager(BlockPool(32), block_size=4)
    live: list[Sequence] = []
    for step in range(2000):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = [1, 2, 3, 4, 5, 6, 7, 8][: rng.choice([0, 4, 8])]
            s = _seq(step, prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 12))])
            kv.match_prefix(s)
            n = s.num_uncomputed_tokens
            if kv.allocate(s, n):
                s.num_computed_tokens += n
                kv.cache_full_blocks(s)
                live.append(s)
            else:
                kv.free(s)
        kv.pool.check_invariants()
        held = sum(len(s.block_ids) for s in live)
        assert sum(kv.pool.ref_count(b) for b in range(32)) == held
    for s in live:
        kv.free(s)
    assert kv.pool.num_free == 32


def test_token_slice_spans_prompt_and_output():
    s = Sequence("s", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert s.token_slice(start, end) == s.token_ids()[start:end]


def test_blocks_freed_together_come_back_as_one_ascending_run():
    pool = BlockPool(12)
    first = pool.allocate(4)
    second = pool.allocate(4)
    pool.free(reversed(first))  # a sequence frees its tail first
    pool.free(reversed(second))
    pool.allocate(4)  # the untouched blocks 8..11 go first (least recently freed)
    assert pool.allocate(4) == first
    assert pool.allocate(4) == second
    pool.check_invariants()
