"""A worker's torch threads: sized on a Ray node it joined, elastic on a shared CPU host.

On a Ray cluster that ``tandem serve --ray-address`` joins, the workers' hosts are not
the gateway's: a CPU worker left without a thread count sizes itself on its own node
(``node_threads``), sharing the CPUs that node advertises to Ray among the workers its
pool's custom resource admits there (a Helm worker pod: its CPU request over its
``workersPerPod``).

On a CPU host the pools share cores. A worker pinned to its share leaves the other
pool's cores idle whenever that pool has nothing to do, and a worker with every core's
worth of threads fights the other pool for them while it has. ``ElasticThreads`` picks
per moment: ``burst`` threads while nothing of the other pool contends, ``base``
otherwise. For a decode worker that is while no remote prefill is pending for it (none
reserved whose KV has not arrived); for a prefill worker, while the decode workers hold
no request but those it is prefilling itself (``decode_board``).

Thread counts in OpenMP are per calling thread, so the count is applied on the engine
loop's thread, between steps (a decode worker through ``EngineLoop.submit``, a prefill
worker through ``EngineLoop.between_steps``); a step already running finishes
with the count it started with.
"""

from __future__ import annotations

import logging
import math
import os

import torch

log = logging.getLogger(__name__)

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


# Ray's own resources; any other name a worker asks for is a pool's custom resource
# (``tandem_prefill``, ``--prefill-resource NAME=AMOUNT``), which bounds how many workers
# of that pool one node holds.
RAY_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def share_of_node(asked: dict[str, float], node: dict[str, float], cores: int) -> int:
    """Torch threads for one worker on a Ray node: the node's CPUs (as Ray counts them,
    at most ``cores``, those this process may use) shared among as many workers as the
    node's custom resources admit; 1 when the worker asks for none (then nothing bounds
    how many share the node).

    ``asked``: the resources Ray assigned the worker; ``node``: the node's totals. E.g. a
    pod of 4 CPUs advertising ``tandem_prefill: 2`` gives each of its two prefill workers
    2 threads. Only the worker's own pool is counted: on a node that advertises both
    pools' resources, each pool takes all of its CPUs (set ``--threads-per-worker`` there).
    """
    admits = [math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in asked.items()
              if amount > 0 and name not in RAY_RESOURCES and ":" not in name]
    if not admits:
        return 1
    cpus = min(cores, math.floor(node.get("CPU", 0.0) + 1e-9))
    return max(1, cpus // max(1, min(admits)))


def node_threads() -> int | None:
    """``share_of_node`` for the Ray actor calling it, read from Ray and its own usable
    cores (None outside an actor)."""
    import ray

    if not (ray.is_initialized() and ray.get_runtime_context().get_actor_id()):
        return None
    context = ray.get_runtime_context()
    try:
        node_id = context.get_node_id()
        node = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), None)
        if node is None:
            raise LookupError(f"node {node_id} is not among Ray's nodes")
        return share_of_node(context.get_assigned_resources(), node, usable_cores())
    except Exception as e:  # noqa: BLE001 - a worker starts on one thread rather than not at all
        log.warning("torch threads not sized on this Ray node (%s): running 1", e)
        return 1


class ElasticThreads:
    """An engine's thread count: ``burst`` while nothing of the other pool contends, else ``base``.

    ``burst <= base`` turns it off (the count stays ``base``).
    """

    def __init__(self, base: int, burst: int) -> None:
        if base < 1:
            raise ValueError(f"base threads must be >= 1, got {base}")
        if burst < 0:
            raise ValueError(f"burst threads must be >= 0, got {burst}")
        self.base, self.burst = base, max(base, burst)
        self.current: int | None = None  # unknown until first applied on the loop thread
        self.switches = 0  # how often the count changed (a counter for stats)

    @property
    def enabled(self) -> bool:
        return self.burst > self.base

    @property
    def bursting(self) -> bool:
        """Whether the count last applied is above ``base``."""
        return self.current is not None and self.current > self.base

    def wanted(self, contending: int) -> int:
        """Threads for the next steps given how many of the other pool's requests contend
        (a decode worker: remote prefills pending for it; a prefill worker: requests the
        decode workers hold beyond its own)."""
        return self.base if contending > 0 else self.burst

    def apply(self, contending: int) -> int:
        """Set the calling thread's torch thread count (call on the engine loop thread)."""
        n = self.wanted(contending)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
            self.switches += 1
        return n
