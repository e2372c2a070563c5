"""Torch thread counts of a CPU cluster's workers, sized to the host unless set.

A CPU cluster that ``tandem serve`` starts on this host (its own Ray, no
``--ray-address``) runs every worker here. Unless set, each worker then gets an equal
share of the cores this process may use (``threads_per_worker``), and each decode worker
of a disaggregated or conditional cluster takes its share of all of them while no
prefill is pending for it (``decode_burst_threads``, see ``tandem.worker.threads``),
and each prefill worker its share of all of them while the decode workers hold no request
but those being prefilled (``prefill_burst_threads``, ``tandem.worker.decode_board``):
on 2 cores, 1 prefill + 1 decode worker run one thread each, the decode worker two while
no prompt is being prefilled for it, the prefill worker two while nothing decodes.

On a Ray cluster it joins, the workers' hosts are not this one: a CPU worker left
without a count sizes itself on its own node (``tandem.worker.threads.node_threads``:
the CPUs that node advertises to Ray, shared among the workers its pool's custom resource
admits there), and workers do not burst unless set (the pools may not share a host; a
prefill worker bursts only on a cluster started here, which has the board it reads). CUDA
workers run 1 thread unless set.
"""

from __future__ import annotations

import dataclasses

from tandem.common.config import ClusterConfig
from tandem.worker.threads import usable_cores


def resolve(config: ClusterConfig, cores: int | None = None) -> ClusterConfig:
    """``config`` with its unset thread counts decided (see the module docstring);
    ``cores``: this host's usable cores (default: ``usable_cores()``). Counts the
    config sets are kept as they are. A CPU cluster that joins Ray keeps an unset
    ``threads_per_worker`` None: each worker sizes itself on its node."""
    cpu = config.engine.device == "cpu"
    local = cpu and config.ray_address is None
    cores = cores or usable_cores()
    threads = config.threads_per_worker
    colocated = config.mode == "colocated"
    workers = config.decode_workers + config.prefill_workers
    if threads is None and local:
        threads = max(1, cores // workers)
    elif threads is None and not cpu:
        threads = 1

    def burst(asked: int | None, pool: int) -> int:
        if asked is None:
            asked = max(threads, cores // pool) if local and not colocated else 0
        return 0 if threads is not None and asked <= threads else asked
    return dataclasses.replace(
        config, threads_per_worker=threads,
        decode_burst_threads=burst(config.decode_burst_threads, config.decode_workers),
        prefill_burst_threads=0 if colocated or config.ray_address is not None else burst(
            config.prefill_burst_threads, config.prefill_workers))


def describe(config: ClusterConfig) -> str:
    """One line for the start-up log: the thread counts a resolved ``config`` runs."""
    if config.threads_per_worker is None:
        text = "torch threads per worker sized on its Ray node"
    else:
        text = f"{config.threads_per_worker} torch thread(s) per worker"
    if config.decode_burst_threads:
        text += f", decode workers {config.decode_burst_threads} while no prefill is pending for them"
    if config.prefill_burst_threads:
        text += f", prefill workers {config.prefill_burst_threads} while nothing decodes"
    return text
