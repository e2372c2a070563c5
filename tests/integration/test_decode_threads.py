"""A decode worker with burst threads in a real disaggregated cluster (Ray actors, gloo
KV transfer), as a cluster started here sizes them when nothing is set: it drops to its
base thread count while a prefill is pending for it and takes the burst count back once
the KV has arrived; outputs stay the offline engine's."""

from __future__ import annotations

import asyncio

import pytest

from services.cluster.cluster import Cluster
from services.worker.threads import usable_cores
from tests.integration.test_cluster import _config, prompts, reference, run_all, wait_all_free  # noqa: F401


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint):
    if usable_cores() < 2:
        pytest.skip("one usable core: nothing to burst into")
    c = Cluster(_config(checkpoint, prefill_workers=1, decode_workers=1)).start()  # counts unset
    yield c
    c.shutdown()


def test_decode_threads_follow_pending_prefills(cluster, prompts, reference):  # noqa: F811
    cores = usable_cores()
    assert (cluster.config.threads_per_worker, cluster.config.decode_burst_threads) == \
        (cores // 2, cores)
    assert run_all(cluster, prompts) == reference
    stats = wait_all_free(cluster)
    decode = next(s for s in stats if s["role"] == "decode")
    # Start-up applied the burst count; every request dropped to the base count at its
    # reservation and went back once its KV had arrived (concurrent requests share one dip).
    assert decode["threads"] == cores
    assert decode["thread_switches"] >= 3 and decode["thread_switches"] % 2 == 1
    assert decode["pending_transfers"] == 0
    prefill = next(s for s in stats if s["role"] == "prefill")
    assert prefill["threads"] == cores // 2 and "thread_switches" not in prefill


def test_colocated_workers_keep_their_threads(ray_session, checkpoint):
    c = Cluster(_config(checkpoint, mode="colocated", prefill_workers=0, decode_workers=1,
                        threads_per_worker=1, decode_burst_threads=2)).start()
    try:
        stats = asyncio.run(c.worker_stats())
        assert [s["threads"] for s in stats] == [1] and stats[0]["thread_switches"] == 0
    finally:
        c.shutdown()
