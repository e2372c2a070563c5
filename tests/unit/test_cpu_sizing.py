"""Thread counts left unset are sized to the host's usable cores for a cluster started
here on CPU; a CPU cluster joining Ray leaves them to each worker's node, a CUDA cluster
runs one thread a worker, no burst; set counts are kept."""

from __future__ import annotations

import os

import pytest

from tandem.cluster import cpu_sizing
from tandem.common.config import ClusterConfig, EngineConfig


def _sized(cores: int, **kw) -> tuple[int, int]:
    c = cpu_sizing.resolve(ClusterConfig(**kw), cores=cores)
    return c.threads_per_worker, c.decode_burst_threads


def _prefill_burst(cores: int, **kw) -> int:
    return cpu_sizing.resolve(ClusterConfig(**kw), cores=cores).prefill_burst_threads


@pytest.mark.parametrize("cores,kw,expected,prefill_burst", [
    # 1P+1D: one core each; decode takes both while no prefill is pending, prefill while
    # nothing decodes
    (2, {}, (1, 2), 2),
    (16, {}, (8, 16), 16),
    (2, dict(prefill_workers=2), (1, 2), 0),  # 3 workers on 2 cores: 1 each, prefill 1 share
    (4, dict(prefill_workers=1, decode_workers=2), (1, 2), 4),  # the decode workers share the host
    (3, {}, (1, 3), 3),
    (1, {}, (1, 0), 0),  # nothing to burst into
    (2, dict(decode_workers=2), (1, 0), 2),  # 1 + 1 share of 2 cores among 2 decode workers: off
    (2, dict(mode="conditional"), (1, 2), 2),
    (8, dict(mode="colocated", prefill_workers=0, decode_workers=2), (4, 0), 0),  # colocated: none
    (8, dict(mode="colocated", prefill_workers=1, decode_workers=1), (4, 0), 0),
])
def test_local_cpu_cluster_shares_the_cores(cores, kw, expected, prefill_burst):
    assert _sized(cores, **kw) == expected
    assert _prefill_burst(cores, **kw) == prefill_burst


def test_set_counts_are_kept():
    assert _sized(16, threads_per_worker=2) == (2, 16)
    assert _sized(16, decode_burst_threads=0) == (8, 0)
    assert _sized(16, threads_per_worker=3, decode_burst_threads=5) == (3, 5)
    assert _sized(2, threads_per_worker=2, decode_burst_threads=2) == (2, 0)  # not above base: off
    assert _prefill_burst(16, prefill_burst_threads=0) == 0
    assert _prefill_burst(16, threads_per_worker=3, prefill_burst_threads=5) == 5
    assert _prefill_burst(2, threads_per_worker=2, prefill_burst_threads=2) == 0


def test_a_joined_cpu_cluster_leaves_the_count_to_each_worker_and_does_not_burst():
    joined = dict(ray_address="10.0.0.1:6379")
    assert _sized(16, **joined) == (None, 0)  # tandem.worker.threads.node_threads decides
    assert _sized(16, decode_burst_threads=8, **joined) == (None, 8)
    assert _sized(16, threads_per_worker=4, decode_burst_threads=8, **joined) == (4, 8)
    assert _prefill_burst(16, **joined) == 0  # the board it would read is this host's
    with pytest.raises(ValueError, match="prefill_burst_threads needs the pools on one host"):
        ClusterConfig(prefill_burst_threads=4, **joined)
    assert cpu_sizing.describe(cpu_sizing.resolve(ClusterConfig(**joined), cores=16)) == \
        "torch threads per worker sized on its Ray node"


def test_cuda_workers_run_one_thread_and_do_not_burst():
    cuda = dict(engine=EngineConfig(device="cuda"))
    for where in ({}, dict(ray_address="10.0.0.1:6379")):
        assert _sized(16, **cuda, **where) == (1, 0)
        assert _sized(16, threads_per_worker=4, decode_burst_threads=8, **cuda, **where) == (4, 8)
    assert _prefill_burst(16, **cuda) == 0
    assert _prefill_burst(16, threads_per_worker=1, prefill_burst_threads=4, **cuda) == 4


def test_usable_cores_reads_the_affinity_and_a_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    limit = tmp_path / "cpu.max"
    limit.write_text("max 100000\n")
    assert cpu_sizing.usable_cores(str(limit)) == affinity
    limit.write_text("50000 100000\n")  # half a core: still one
    assert cpu_sizing.usable_cores(str(limit)) == 1
    limit.write_text(f"{(affinity + 3) * 100000} 100000\n")  # a quota above the affinity
    assert cpu_sizing.usable_cores(str(limit)) == affinity
    assert cpu_sizing.usable_cores(str(tmp_path / "missing")) == affinity


def test_the_start_up_line_says_what_runs():
    c = cpu_sizing.resolve(ClusterConfig(), cores=2)
    assert cpu_sizing.describe(c) == ("1 torch thread(s) per worker, decode workers 2 while no "
                                      "prefill is pending for them, prefill workers 2 while "
                                      "nothing decodes")
    assert cpu_sizing.describe(cpu_sizing.resolve(ClusterConfig(), cores=1)) == \
        "1 torch thread(s) per worker"


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="threads_per_worker"):
        ClusterConfig(threads_per_worker=0)
    with pytest.raises(ValueError, match="decode_burst_threads"):
        ClusterConfig(decode_burst_threads=-1)
    with pytest.raises(ValueError, match="prefill_burst_threads"):
        ClusterConfig(prefill_burst_threads=-1)
