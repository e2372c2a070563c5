"""Router placement, admission control and in-flight accounting, against fake workers."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import pytest

from tandem.router import (ClusterFullError, NoWorkersError, PromptTooLargeError, Router,
                             RouterConfig, WorkerHandle, WorkerLoad)


class FakeWorker:
    """A WorkerHandle whose load snapshot the test sets directly."""

    def __init__(self, worker_id: str, role: str, *, total: int = 100, free: int | None = None,
                 running: int = 0, waiting: int = 0, queued: int = 0, max_num_seqs: int = 8,
                 block_size: int = 16, alive: bool = True) -> None:
        self.worker_id = worker_id
        self.role = role
        self.snapshot = WorkerLoad(worker_id=worker_id, role=role, alive=alive,
                                   total_blocks=total,
                                   free_blocks=total if free is None else free,
                                   block_size=block_size, running=running, waiting=waiting,
                                   queued_prefill_tokens=queued, max_num_seqs=max_num_seqs)

    def load(self) -> WorkerLoad:
        return self.snapshot

    def update(self, **changes) -> None:
        if "request_ids" in changes:
            changes["request_ids"] = frozenset(changes["request_ids"])
        self.snapshot = replace(self.snapshot, **changes)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)]


def make(mode: str = "disaggregated", **cfg) -> RouterConfig:
    return RouterConfig(mode=mode, **cfg)


def test_fake_satisfies_the_protocol():
    assert isinstance(FakeWorker("d0", "decode"), WorkerHandle)


# -- decode first -------------------------------------------------------------------------

def test_decode_with_most_free_blocks_wins():
    d0, d1, p0 = FakeWorker("d0", "decode", free=50), FakeWorker("d1", "decode", free=90), \
        FakeWorker("p0", "prefill")
    d = Router(make(), [d0, d1, p0]).route("r1", prompt(40), 16)
    assert (d.decode.worker_id, d.prefill.worker_id, d.reason) == ("d1", "p0", "remote")
    assert d.prefix_hit_blocks == 0 and d.attempt == 0 and not d.local_prefill


def test_least_loaded_decode_wins_at_equal_room():
    d0 = FakeWorker("d0", "decode", running=6, free=80)
    d1 = FakeWorker("d1", "decode", running=1, waiting=1, free=80)
    r = Router(make(), [d0, d1, FakeWorker("p0", "prefill")])
    assert r.route("r1", prompt(40), 16).decode is d1


def test_free_blocks_and_load_are_traded_off():
    # d0: 90/100 free but a full batch (8/8 running); d1: 60/100 free, idle.
    d0 = FakeWorker("d0", "decode", free=90, running=8)
    d1 = FakeWorker("d1", "decode", free=60)
    r = Router(make(), [d0, d1, FakeWorker("p0", "prefill")])
    assert r.route("r1", prompt(40), 16).decode is d1  # 0.9 - 1.0 < 0.6 - 0.125


def test_ties_are_broken_by_worker_id_not_registration_order():
    workers = [FakeWorker("d1", "decode"), FakeWorker("d0", "decode"), FakeWorker("p1", "prefill"),
               FakeWorker("p0", "prefill")]
    d = Router(make(), workers).route("r1", prompt(40), 16)
    assert (d.decode.worker_id, d.prefill.worker_id) == ("d0", "p0")


# -- in-flight promises -------------------------------------------------------------------

def test_promised_blocks_count_until_the_load_shows_the_request():
    d0, d1 = FakeWorker("d0", "decode", total=20), FakeWorker("d1", "decode", total=20, free=18)
    r = Router(make(), [d0, d1, FakeWorker("p0", "prefill")])
    p = prompt(100)  # 101 tokens -> 7 blocks of 16
    # A burst with no load refresh in between spreads by the promised blocks.
    assert [r.route(f"r{i}", p, 8).decode.worker_id for i in (1, 2, 3)] == ["d0", "d1", "d0"]
    assert r.pending_summary()["blocks"] == 21
    assert r.route("r4", p, 8).decode is d1  # d0: 20-14=6 free, d1: 18-7=11
    with pytest.raises(ClusterFullError):  # d0: 6, d1: 4
        r.route("r5", p, 8)
    assert r.pending_summary()["blocks"] == 28 and r.in_flight() == 4
    # The loads catch up: the promises stop counting (no double counting).
    d0.update(free_blocks=6, request_ids={"r1", "r3"})
    d1.update(free_blocks=4, request_ids={"r2", "r4"})
    summary = r.pending_summary()  # observed lazily: nothing routed since
    assert summary["blocks"] == 28
    with pytest.raises(ClusterFullError):
        r.route("r5", p, 8)
    assert r.pending_summary()["blocks"] == 0
    # A request that leaves the worker's list again is not counted again.
    d0.update(free_blocks=20, request_ids=set())
    assert r.route("r5", p, 8).decode is d0
    assert r.pending_summary()["blocks"] == 7


def test_promised_queue_slots_count_towards_the_load():
    d0, d1 = FakeWorker("d0", "decode", running=2), FakeWorker("d1", "decode", running=3)
    r = Router(make(), [d0, d1, FakeWorker("p0", "prefill")])
    # d0 busy 2 -> 3 after r1, blocks 100 -> 97; then d1 (3 busy, 100 free) beats it.
    got = [r.route(f"r{i}", prompt(40), 8).decode.worker_id for i in range(4)]
    assert got == ["d0", "d1", "d0", "d1"]
    assert r.pending_summary()["queued"] == 8  # 4 on decode + 4 on the prefill worker


# -- prefix affinity ----------------------------------------------------------------------

def test_repeated_prompt_sticks_to_the_prefill_worker_that_has_it():
    p0, p1 = FakeWorker("p0", "prefill"), FakeWorker("p1", "prefill", queued=100)
    r = Router(make(), [FakeWorker("d0", "decode", total=1000), p0, p1])
    long_prompt = prompt(1024)
    first = r.route("r1", long_prompt, 8)
    assert first.prefill is p0 and first.prefix_hit_blocks == 0
    # p0 now has 1024 pending tokens (not reported yet) but holds the prefix:
    # 1024 - 63 * 16 = 16 < 100 (at least one token is recomputed: 63 of 64 blocks).
    second = r.route("r2", long_prompt, 8)
    assert second.prefill is p0 and second.prefix_hit_blocks == 63
    assert r.pending_summary()["tokens"] == 1024 + 16
    # A different prompt of the same length goes by load: 1040 on p0 vs 100 on p1.
    other = r.route("r3", prompt(1024, seed=1), 8)
    assert other.prefill is p1 and other.prefix_hit_blocks == 0
    # A shared 512-token prefix counts its 32 leading blocks.
    shared = long_prompt[:512] + prompt(512, seed=2)
    p1.update(queued_prefill_tokens=2000)
    assert r.route("r4", shared, 8).prefix_hit_blocks == 32


def test_affinity_yields_when_the_holder_is_much_more_loaded():
    p0, p1 = FakeWorker("p0", "prefill"), FakeWorker("p1", "prefill", queued=100)
    r = Router(make(), [FakeWorker("d0", "decode", total=1000), p0, p1])
    long_prompt = prompt(1024)
    assert r.route("r1", long_prompt, 8).prefill is p0
    p0.update(queued_prefill_tokens=5000, request_ids={"r1"})  # 5000 - 1008 > 100
    d = r.route("r2", long_prompt, 8)
    assert d.prefill is p1 and d.prefix_hit_blocks == 0


def test_prefix_weight_zero_disables_affinity():
    p0, p1 = FakeWorker("p0", "prefill"), FakeWorker("p1", "prefill", queued=100)
    r = Router(make(prefix_weight=0.0), [FakeWorker("d0", "decode", total=1000), p0, p1])
    r.route("r1", prompt(1024), 8)
    assert r.route("r2", prompt(1024), 8).prefill is p1


# -- modes --------------------------------------------------------------------------------

def test_conditional_short_prompt_prefills_locally():
    r = Router(make("conditional", local_prefill_threshold=256),
               [FakeWorker("d0", "decode"), FakeWorker("p0", "prefill")])
    short, at = r.route("r1", prompt(255), 8), r.route("r2", prompt(256), 8)
    assert (short.prefill, short.reason, short.decode.worker_id) == (None, "local_short_prompt",
                                                                     "d0")
    assert short.local_prefill
    assert (at.prefill.worker_id, at.reason) == ("p0", "remote")
    assert r.decisions["local_short_prompt"] == 1 and r.decisions["remote"] == 1


def test_conditional_saturated_prefill_pool_prefills_locally():
    p0 = FakeWorker("p0", "prefill", queued=1001)
    p1 = FakeWorker("p1", "prefill", queued=1001)
    r = Router(make("conditional", local_prefill_threshold=16, prefill_saturation_tokens=1000),
               [FakeWorker("d0", "decode"), p0, p1])
    d = r.route("r1", prompt(64), 8)
    assert (d.prefill, d.reason) == (None, "local_prefill_saturated")
    assert r.pending_summary()["tokens"] == 64  # counted on the decode worker
    p1.update(queued_prefill_tokens=1000)  # at the threshold is not saturated
    d = r.route("r2", prompt(64, seed=1), 8)
    assert (d.prefill, d.reason) == (p1, "remote")
    # p1's own pending 64 tokens now push it over: saturated again.
    assert r.route("r3", prompt(64, seed=2), 8).reason == "local_prefill_saturated"
    assert r.decisions == {"remote": 1, "local_short_prompt": 0, "local_prefill_saturated": 2,
                           "local_prefill_unavailable": 0, "colocated": 0, "local_resume": 0}


def test_conditional_saturation_is_the_wait_at_the_measured_prefill_rate():
    """A worker that measured its rate is saturated by seconds of backlog, not by tokens."""
    slow = FakeWorker("p0", "prefill", queued=3000)
    slow.update(prefill_tokens_per_s=1000.0)  # 3 s of queued prompts
    fast = FakeWorker("p1", "prefill", queued=3000)
    fast.update(prefill_tokens_per_s=4000.0)  # 0.75 s
    cfg = dict(local_prefill_threshold=16, prefill_saturation_s=1.0,
               prefill_saturation_tokens=100)  # the token bound no longer applies
    r = Router(make("conditional", **cfg), [FakeWorker("d0", "decode"), slow, fast])
    d = r.route("r1", prompt(900), 8)
    assert (d.prefill, d.reason) == (fast, "remote")
    # fast's promised 900 tokens: 3,900 queued at 4,000/s is still under a second
    assert r.route("r2", prompt(200, seed=1), 8).prefill is fast
    # 4,100 queued: over a second on both workers
    assert r.route("r3", prompt(64, seed=2), 8).reason == "local_prefill_saturated"
    slow.update(queued_prefill_tokens=1000)  # 1.0 s: at the bound is not saturated
    fast.update(queued_prefill_tokens=40000)
    assert r.route("r4", prompt(64, seed=3), 8).prefill is slow
    # disaggregated mode never keeps a prompt on the decode worker for its backlog
    r = Router(make(**cfg), [FakeWorker("d0", "decode"), slow])
    slow.update(queued_prefill_tokens=10**6)
    assert r.route("r5", prompt(64, seed=4), 8).reason == "remote"


def test_prefill_workers_rank_by_wait_once_every_one_measured_its_rate():
    slow = FakeWorker("p0", "prefill", queued=1000)
    slow.update(prefill_tokens_per_s=500.0)  # 2 s
    fast = FakeWorker("p1", "prefill", queued=3000)
    r = Router(make(), [FakeWorker("d0", "decode"), slow, fast])
    assert r.route("r1", prompt(32), 8).prefill is slow  # fast has no rate yet: by tokens
    r.release("r1")
    fast.update(prefill_tokens_per_s=4000.0)  # 0.75 s
    assert r.route("r2", prompt(32, seed=1), 8).prefill is fast
    r.release("r2")
    # both idle: the faster computes the prompt itself sooner, whatever the ids say
    slow.update(queued_prefill_tokens=0)
    fast.update(queued_prefill_tokens=0)
    assert r.route("r3", prompt(320, seed=2), 8).prefill is fast


def test_prefill_saturation_s_must_be_finite_and_non_negative():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="prefill_saturation_s"):
            make("conditional", prefill_saturation_s=bad)


def test_colocated_uses_the_both_pool_and_no_prefill_worker():
    b0, b1 = FakeWorker("b0", "both", free=40), FakeWorker("b1", "both", free=60)
    others = [FakeWorker("d0", "decode", free=100), FakeWorker("p0", "prefill")]
    r = Router(make("colocated"), [b0, b1, *others])
    d = r.route("r1", prompt(100), 8)
    assert (d.decode, d.prefill, d.reason, d.prefix_hit_blocks) == (b1, None, "colocated", 0)
    again = r.route("r2", prompt(100), 8)  # b1: 60-7=53 free still beats 40
    assert (again.decode, again.prefix_hit_blocks) == (b1, 6)
    assert r.pending_summary()["tokens"] == 100 + 4  # local prefill tokens on b1
    with pytest.raises(NoWorkersError):
        Router(make("colocated"), others).route("r1", prompt(10), 8)


def test_disaggregated_without_prefill_workers_falls_back_or_refuses():
    p0 = FakeWorker("p0", "prefill", alive=False)
    r = Router(make(), [FakeWorker("d0", "decode"), p0])
    d = r.route("r1", prompt(64), 8)
    assert (d.prefill, d.reason) == (None, "local_prefill_unavailable")
    strict = Router(make(local_prefill_fallback=False), [FakeWorker("d0", "decode"), p0])
    with pytest.raises(NoWorkersError, match="no alive prefill worker"):
        strict.route("r1", prompt(64), 8)
    assert strict.pending_summary()["requests"] == 0


# -- admission control --------------------------------------------------------------------

def test_full_queues_are_refused_at_once_with_a_retry_hint(monkeypatch):
    d0 = FakeWorker("d0", "decode")
    r = Router(make(max_queued_requests=2, retry_after_s=0.5), [d0, FakeWorker("p0", "prefill")])
    r.route("r1", prompt(16), 8), r.route("r2", prompt(16), 8)
    before = r.pending_summary()
    waits, me = [], threading.get_ident()  # at once: the refusal never sleeps or waits for room

    def refused_without_waiting(wait):
        def call(*args, **kwargs):
            if threading.get_ident() != me:  # another thread's waits are not the router's
                return wait(*args, **kwargs)
            waits.append(wait.__qualname__)
            raise AssertionError(f"the router waited ({wait.__qualname__}) before refusing")
        return call
    with monkeypatch.context() as m:
        for owner, name in ((time, "sleep"), (threading.Event, "wait"), (threading.Condition, "wait"),
                            (threading.Condition, "wait_for")):
            m.setattr(owner, name, refused_without_waiting(getattr(owner, name)))
        with pytest.raises(ClusterFullError, match="1 with 2 queued") as exc:
            r.route("r3", prompt(16), 8)
    assert waits == []
    assert exc.value.retry_after_s == 0.5 and not isinstance(exc.value, NoWorkersError)
    assert r.pending_summary() == before  # a refused request leaves nothing behind
    r.complete("r1")
    assert r.route("r3", prompt(16), 8).decode is d0
    d0.update(waiting=2)  # the worker's own queue counts too
    with pytest.raises(ClusterFullError):
        r.route("r4", prompt(16), 8)


def test_no_room_and_no_decode_worker_are_refused():
    r = Router(make(), [FakeWorker("d0", "decode", total=10, free=3), FakeWorker("p0", "prefill")])
    with pytest.raises(ClusterFullError, match="1 without free KV blocks"):
        r.route("r1", prompt(64), 8)  # 65 tokens need 5 blocks
    with pytest.raises(PromptTooLargeError):
        r.route("r1", prompt(160), 8)  # 161 tokens need 11 > 10 blocks in total
    with pytest.raises(NoWorkersError) as exc:
        Router(make(), [FakeWorker("p0", "prefill")]).route("r1", prompt(8), 8)
    assert isinstance(exc.value, ClusterFullError) and exc.value.retry_after_s == 1.0


def test_full_prefill_queues_refuse_in_disaggregated_mode():
    p0 = FakeWorker("p0", "prefill", waiting=1)
    r = Router(make(max_queued_requests=1), [FakeWorker("d0", "decode"), p0])
    with pytest.raises(ClusterFullError, match="prefill workers"):
        r.route("r1", prompt(64), 8)
    assert r.pending_summary()["requests"] == 0


def test_duplicate_request_ids_and_empty_prompts_are_rejected():
    r = Router(make(), [FakeWorker("d0", "decode"), FakeWorker("p0", "prefill")])
    r.route("r1", prompt(8), 8)
    with pytest.raises(ValueError, match="already routed"):
        r.route("r1", prompt(8), 8)
    with pytest.raises(ValueError, match="empty"):
        r.route("r2", [], 8)


# -- failures -----------------------------------------------------------------------------

def test_dead_workers_are_skipped_until_replaced():
    d0, d1 = FakeWorker("d0", "decode", free=50), FakeWorker("d1", "decode")
    p0, p1 = FakeWorker("p0", "prefill"), FakeWorker("p1", "prefill", queued=10)
    r = Router(make(), [d0, d1, p0, p1])
    r.route("r1", prompt(32), 8)
    r.mark_dead("d1"), r.mark_dead("p0")
    assert r.pending_summary()["blocks"] == 0  # the dead worker's promises are gone
    d = r.route("r2", prompt(32), 8)
    assert (d.decode, d.prefill) == (d0, p1)
    d0.update(alive=False)  # reported dead by its load
    with pytest.raises(NoWorkersError):
        r.route("r3", prompt(32), 8)
    replacement = FakeWorker("d1", "decode")
    r.add_worker(replacement)
    assert r.route("r3", prompt(32), 8).decode is replacement


def test_retry_excludes_the_failed_worker_and_moves_the_promises():
    d0, d1 = FakeWorker("d0", "decode", free=50), FakeWorker("d1", "decode")
    r = Router(make(), [d0, d1, FakeWorker("p0", "prefill")])
    assert r.route("r1", prompt(32), 8).decode is d1
    d = r.retry("r1", {"d1"}, prompt_token_ids=prompt(32) + [5] * 20, max_tokens=4)
    assert (d.decode, d.attempt, d.reason) == (d0, 1, "remote")
    assert r.retries == 1 and r.decisions["remote"] == 2
    # 53 tokens need 4 blocks; p0 still holds the first 2 blocks: 52 - 32 tokens to prefill.
    assert d.prefix_hit_blocks == 2
    summary = r.pending_summary()
    assert (summary["blocks"], summary["tokens"], summary["requests"]) == (4, 20, 1)
    with pytest.raises(ClusterFullError):  # no decode worker left
        r.retry("r1", {"d0", "d1"})
    assert r.pending_summary()["blocks"] == 0 and r.in_flight() == 1
    assert r.retry("r1").attempt == 3
    assert r.release("r1") and not r.release("r1")
    with pytest.raises(KeyError):
        r.retry("r1", {"d0"})


def test_a_resumed_stream_is_placed_even_where_the_cache_is_full():
    """A stream already under way, re-driven: the decode worker prefills prompt + tokens so
    far itself, and lack of room or a full queue does not cut the stream (the worker queues
    it until blocks free), but a worker too small for it is never chosen."""
    d0 = FakeWorker("d0", "decode", total=100, free=3, waiting=8)
    d1 = FakeWorker("d1", "decode", total=100, free=10, running=2)
    small = FakeWorker("d2", "decode", total=10, free=10)
    r = Router(make(max_queued_requests=8), [d0, d1, small, FakeWorker("p0", "prefill")])
    r.route("r1", prompt(16), 400)
    resumed = prompt(16) + [5] * 300  # 316 tokens: 20 blocks, more than any has free
    with pytest.raises(ClusterFullError):
        r.retry("r1", prompt_token_ids=resumed, max_tokens=100)
    d = r.retry("r1", prompt_token_ids=resumed, max_tokens=100, resume=True)
    assert (d.decode, d.prefill, d.reason) == (d1, None, "local_resume")
    assert r.decisions["local_resume"] == 1
    summary = r.pending_summary()  # promised to d1 alone: its blocks and tokens to prefill
    assert (summary["workers"], summary["blocks"], summary["tokens"]) == (1, 20, 316)
    with pytest.raises(PromptTooLargeError):  # fits no worker at all: still refused
        r.retry("r1", prompt_token_ids=prompt(16) + [5] * 1600, resume=True)


def test_prefill_done_stops_counting_prefill_tokens():
    r = Router(make("conditional", local_prefill_threshold=100),
               [FakeWorker("d0", "decode"), FakeWorker("p0", "prefill")])
    r.route("remote", prompt(200), 8), r.route("local", prompt(50), 8)
    assert r.pending_summary()["tokens"] == 250
    r.prefill_done("remote"), r.prefill_done("local"), r.prefill_done("unknown")
    summary = r.pending_summary()
    assert (summary["tokens"], summary["blocks"], summary["queued"]) == (0, 13 + 4, 2)


# -- no leaks -----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sequences_never_leak_pending_counters(seed):
    rng = random.Random(seed)
    mode = ["disaggregated", "conditional", "colocated"][seed]
    role = "both" if mode == "colocated" else "decode"
    decode = [FakeWorker(f"d{i}", role, total=60) for i in range(3)]
    prefill = [FakeWorker(f"p{i}", "prefill", total=200) for i in range(2)]
    r = Router(make(mode, max_queued_requests=6, local_prefill_threshold=48),
               decode + prefill)
    prefixes = [prompt(64, seed=s) for s in range(3)]
    live: list[str] = []
    routed = refused = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            p = rng.choice(prefixes)[:rng.randint(1, 64)] + prompt(rng.randint(0, 100), step)
            try:
                r.route(f"q{step}", p, 8)
                live.append(f"q{step}")
                routed += 1
            except (ClusterFullError, PromptTooLargeError):
                refused += 1
        elif op < 0.6 and live:
            rid = live.pop(rng.randrange(len(live)))
            assert (r.complete if rng.random() < 0.5 else r.release)(rid)
        elif op < 0.7 and live:
            try:
                r.retry(rng.choice(live), {rng.choice(decode + prefill).worker_id})
                routed += 1
            except ClusterFullError:
                refused += 1
        elif op < 0.75 and live:
            r.prefill_done(rng.choice(live))
        elif op < 0.8:
            r.mark_dead(rng.choice(decode + prefill).worker_id)
        elif op < 0.85:
            r.add_worker(rng.choice(decode + prefill))
        else:  # a load refresh that shows some of the in-flight requests
            w = rng.choice(decode + prefill)
            shown = {x for x in live if rng.random() < 0.3}
            w.update(free_blocks=rng.randint(0, 60), waiting=rng.randint(0, 3),
                     queued_prefill_tokens=rng.randint(0, 500), request_ids=shown,
                     alive=rng.random() < 0.9)
        s = r.pending_summary()
        assert s["requests"] == len(live) >= s["promised_requests"]
        assert min(s.values()) >= 0
    assert routed > 300 and refused > 0 and sum(r.decisions.values()) == routed
    for rid in live:
        (r.complete if rng.random() < 0.5 else r.release)(rid)
    assert r.pending_summary() == {"requests": 0, "promised_requests": 0, "workers": 0,
                                   "blocks": 0, "tokens": 0, "queued": 0}
