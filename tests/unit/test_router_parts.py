"""The router's building blocks: config validation, prefix index, in-flight ledger."""

from __future__ import annotations

import pytest

from tandem.common.block_hash import prefix_hashes
from tandem.router import RouterConfig, WorkerLoad
from tandem.router.ledger import InflightLedger, Pending
from tandem.router.prefix_index import PrefixIndex
from tandem.router.load import blocks_for


def test_config_validates_and_normalizes():
    assert RouterConfig().mode == "disaggregated"
    with pytest.raises(ValueError, match="mode"):
        RouterConfig(mode="split")
    with pytest.raises(ValueError, match="max_queued_requests"):
        RouterConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="prefix_weight"):
        RouterConfig(prefix_weight=float("nan"))
    with pytest.raises(ValueError, match="local_prefill_threshold"):
        RouterConfig(local_prefill_threshold=-1)
    with pytest.raises(Exception):
        RouterConfig().mode = "colocated"  # frozen


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (1, 16, 17, 33)] == [1, 1, 2, 3]


def test_prefix_index_counts_leading_blocks_only():
    idx = PrefixIndex(capacity=100)
    a = prefix_hashes(list(range(64)), 16)
    idx.insert(a)
    assert idx.hits(a) == 4 and len(idx) == 4
    assert idx.hits(prefix_hashes(list(range(40)) + [999] * 24, 16)) == 2
    assert idx.hits(prefix_hashes([7] + list(range(1, 64)), 16)) == 0  # chained hashes


def test_prefix_index_is_bounded_and_evicts_tails_of_old_prompts_first():
    idx = PrefixIndex(capacity=6)
    a, b = prefix_hashes(list(range(64)), 16), prefix_hashes(list(range(100, 164)), 16)
    idx.insert(a), idx.insert(b)
    assert len(idx) == 6
    assert idx.hits(b) == 4 and idx.hits(a) == 2  # a lost its last two blocks, not its root
    idx.hits(a)  # looking is not using
    idx.insert(a[:1])
    idx.insert(prefix_hashes(list(range(200, 216)), 16))
    assert idx.hits(a) == 1 and idx.hits(b) == 4


def test_ledger_promises_end_when_observed_and_never_count_twice():
    ledger = InflightLedger()
    ledger.add("r1", "d0", blocks=3, tokens=0)
    ledger.add("r2", "d0", blocks=2, tokens=10)
    ledger.add("r1", "p0", blocks=0, tokens=40)
    assert ledger.pending("d0") == Pending(5, 10, 2) and ledger.pending("p0") == Pending(0, 40, 1)
    ledger.observe(WorkerLoad("d0", "decode", request_ids=frozenset({"r1", "zz"})))
    assert ledger.pending("d0") == Pending(2, 10, 1)
    ledger.observe(WorkerLoad("d0", "decode"))  # r1 left the worker: stays closed
    assert ledger.pending("d0") == Pending(2, 10, 1)
    ledger.drop_tokens("r2", "d0")
    assert ledger.pending("d0") == Pending(2, 0, 1)
    ledger.drop_worker("p0")
    assert ledger.pending("p0") == Pending() and ledger.num_requests() == 1
    ledger.drop_request("r2"), ledger.drop_request("r2"), ledger.drop("r9", "d0")
    assert ledger.totals() == Pending() and ledger.num_workers() == 0
    assert ledger.num_requests() == 0
