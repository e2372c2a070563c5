"""Torch thread counts of a CPU cluster's workers, sized to the host unless set.

A CPU cluster that ``tandem serve`` starts on this host (its own Ray, no
``--ray-address``) runs every worker here. Unless set, each worker then gets an equal
share of the cores this process may use (``threads_per_worker``), and each decode worker
of a disaggregated or conditional cluster takes its share of all of them while no
prefill is pending for it (``decode_burst_threads``, see ``services.worker.threads``):
on 2 cores, 1 prefill + 1 decode worker run one thread each and the decode worker two
while no prompt is being prefilled for it. On a Ray cluster it joins, the workers' hosts
are not this one: unset counts stay 1 thread a worker, no burst.
"""

from __future__ import annotations

import dataclasses
import math
import os

from services.common.config import ClusterConfig

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def usable_cores(cpu_max_path: str = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota
    (a container's ``--cpus``), at least 1."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open(cpu_max_path) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: the affinity alone
    return max(1, cores)


def resolve(config: ClusterConfig, cores: int | None = None) -> ClusterConfig:
    """``config`` with its unset thread counts decided (see the module docstring);
    ``cores``: this host's usable cores (default: ``usable_cores()``). Counts the
    config sets are kept as they are."""
    local = config.engine.device == "cpu" and config.ray_address is None
    cores = cores or usable_cores()
    threads, burst = config.threads_per_worker, config.decode_burst_threads
    colocated = config.mode == "colocated"
    workers = config.decode_workers + config.prefill_workers
    decode_workers = workers if colocated else config.decode_workers
    if threads is None:
        threads = max(1, cores // workers) if local else 1
    if burst is None:
        burst = max(threads, cores // decode_workers) if local and not colocated else 0
    return dataclasses.replace(config, threads_per_worker=threads,
                               decode_burst_threads=burst if burst > threads else 0)


def describe(config: ClusterConfig) -> str:
    """One line for the start-up log: the thread counts a resolved ``config`` runs."""
    text = f"{config.threads_per_worker} torch thread(s) per worker"
    if config.decode_burst_threads:
        text += f", decode workers {config.decode_burst_threads} while no prefill is pending for them"
    return text
