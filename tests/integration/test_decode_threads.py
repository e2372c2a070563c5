"""Burst threads in a real disaggregated cluster (Ray actors, gloo KV transfer), as a
cluster started here sizes them when nothing is set: the decode worker drops to its base
thread count while a prefill is pending for it and takes the burst count back once the
KV has arrived; the prefill worker runs its base count while a request decodes and the
burst count while nothing does; outputs stay the offline engine's."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tandem.cluster.cluster import Cluster
from tandem.common.sampling_params import SamplingParams
from tandem.worker.threads import usable_cores
from tests.integration.test_cluster import _config, prompts, reference, run_all, wait_all_free  # noqa: F401


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint):
    if usable_cores() < 2:
        pytest.skip("one usable core: nothing to burst into")
    c = Cluster(_config(checkpoint, prefill_workers=1, decode_workers=1)).start()  # counts unset
    board = c.board.path
    yield c
    c.shutdown()
    assert not os.path.exists(os.path.dirname(board)), "the board outlived its cluster"


def test_decode_threads_follow_pending_prefills(cluster, prompts, reference):  # noqa: F811
    cores = usable_cores()
    c = cluster.config
    assert (c.threads_per_worker, c.decode_burst_threads, c.prefill_burst_threads) == \
        (cores // 2, cores, cores)
    assert run_all(cluster, prompts) == reference
    stats = wait_all_free(cluster)
    decode = next(s for s in stats if s["role"] == "decode")
    # Start-up applied the burst count; every request dropped to the base count at its
    # reservation and went back once its KV had arrived (concurrent requests share one dip).
    assert decode["threads"] == cores
    assert decode["thread_switches"] >= 3 and decode["thread_switches"] % 2 == 1
    assert decode["pending_transfers"] == 0
    assert _prefill_settles_at(cluster, cores)["threads"] == cores  # nothing decodes now


def _prefill_settles_at(cluster, threads: int, timeout_s: float = 5.0) -> dict:
    """The prefill worker's stats once it runs ``threads`` (it retunes between steps, and at
    least every 50 ms while idle), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        prefill = next(s for s in asyncio.run(cluster.worker_stats()) if s["role"] == "prefill")
        if prefill["threads"] == threads or time.monotonic() > deadline:
            return prefill
        time.sleep(0.05)


def test_prefill_threads_follow_the_decoding_requests(cluster, prompts):  # noqa: F811
    cores = usable_cores()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    seen: list[int] = []  # the prefill worker's count while the long request decodes

    async def decode_while_watching():
        count = 0
        async for delta in cluster.generate(prompts[0], long):
            count += len(delta.token_ids)
            if count > 1 and (not seen or seen[-1] != cores // 2):
                stats = await cluster.worker_stats()
                seen.append(next(s for s in stats if s["role"] == "prefill")["threads"])
        return count
    assert asyncio.run(decode_while_watching()) == 400
    assert cores // 2 in seen, f"the prefill worker kept {seen} threads while a request decoded"
    wait_all_free(cluster)
    prefill = _prefill_settles_at(cluster, cores)
    assert prefill["threads"] == cores
    assert prefill["thread_switches"] >= 3  # burst at start-up, base while decoding, burst again


def test_colocated_workers_keep_their_threads(ray_session, checkpoint):
    c = Cluster(_config(checkpoint, mode="colocated", prefill_workers=0, decode_workers=1,
                        threads_per_worker=1, decode_burst_threads=2)).start()
    try:
        stats = asyncio.run(c.worker_stats())
        assert [s["threads"] for s in stats] == [1] and stats[0]["thread_switches"] == 0
    finally:
        c.shutdown()


def test_conditional_prefill_worker_bursts_while_nothing_decodes(ray_session, checkpoint, prompts,  # noqa: F811
                                                                 reference):
    """Conditional mode has the board too: local prefills on the decode worker count as
    held there, so the prefill worker bursts only once every request is done."""
    cores = usable_cores()
    if cores < 2:
        pytest.skip("one usable core: nothing to burst into")
    c = Cluster(_config(checkpoint, mode="conditional", prefill_workers=1, decode_workers=1)).start()
    try:
        assert c.config.prefill_burst_threads == cores and c.board is not None
        assert run_all(c, prompts) == reference
        wait_all_free(c)
        assert _prefill_settles_at(c, cores)["threads"] == cores
    finally:
        c.shutdown()
