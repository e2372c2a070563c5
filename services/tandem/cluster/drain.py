"""Scale-down without cutting a stream: a worker drained out of a running cluster.

``drain_worker`` takes one worker out in four steps:

1. the router forgets it, so no new request is placed there; it leaves its pool, so
   neither the healer nor ``/ready`` counts it any more;
2. a decode worker's running requests move to the others with their KV
   (``Cluster.migrations``, where the decode workers are connected): their streams go
   on after a pause of a step or two, nothing prefilled again;
3. the requests still there (a move failed, or no other worker had room) finish in
   place, for up to the drain timeout (the gateway's own count of its requests there,
   ``RayDecode.active``, and the worker's load must both be empty, twice, one refresh
   apart);
4. the actor exits. Requests still running then fail on it and take the re-drive path
   (``RequestDriver``): each goes on on another worker of the pool with its prompt plus
   the tokens already sent, and the client's stream continues without a gap or a repeat.

A decode worker leaves the transfer group as it exits (no other rank receives from it);
a prefill worker's departure rebuilds the group, with requests waiting (bounded) for it
meanwhile, and transfers in flight at that moment re-driven.

Heals and drains change the pools one at a time (``Cluster._membership``), but the
wait of step 2 holds no lock: a worker that dies meanwhile is replaced as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from tandem.cluster.cluster import Cluster

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 30.0  # how long a drained worker's requests may run before re-drive
POLL_S = 0.05
SETTLE_TIMEOUT_S = 30.0  # for the streams of a stopped worker to end or move on
GROUP_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class DrainReport:
    """How a drain went: ``migrated`` requests moved off with their KV; ``idle`` when the
    rest finished in place; otherwise the ``redriven`` requests still on the worker went
    on elsewhere (prefilled again) when its actor exited."""

    worker_id: str
    idle: bool
    redriven: int
    seconds: float
    migrated: int = 0


def drain_worker(cluster: Cluster, worker_id: str,
                 timeout_s: float = DRAIN_TIMEOUT_S) -> DrainReport:
    """Drain ``worker_id`` out of ``cluster`` (see the module docstring).

    Raises ``KeyError`` for a worker the cluster does not have and ``ValueError`` for
    the last worker of its pool (the pool would be empty) or a negative timeout.
    """
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
    t0 = time.monotonic()
    with cluster._membership:
        workers = cluster.prefill + cluster.decode
        worker = next((w for w in workers if w.worker_id == worker_id), None)
        if worker is None:
            known = ", ".join(w.worker_id for w in workers)
            raise KeyError(f"no worker {worker_id!r} in the cluster (workers: {known})")
        is_prefill = worker in cluster.prefill
        if len(cluster.prefill if is_prefill else cluster.decode) == 1:
            raise ValueError(f"{worker_id} is the last {worker.role} worker of the cluster: "
                             "it cannot be drained")
        cluster._progress(f"draining {worker_id} (up to {timeout_s:g}s)")
        cluster.router.remove_worker(worker_id)  # no new request goes there from now on
        if is_prefill:
            cluster.prefill = [w for w in cluster.prefill if w is not worker]
        else:
            cluster.decode = [w for w in cluster.decode if w is not worker]
        cluster.placement.pop(worker_id, None)
        cluster.publish_placement()
        cluster.draining[worker_id] = worker  # a shutdown meanwhile stops it too
    try:
        moved = 0 if is_prefill else _move_off(cluster, worker)
        # a worker whose requests all moved reports idle at once: a zero timeout too
        idle = _wait_idle(worker, max(t0 + timeout_s, time.monotonic() + (1.0 if moved else 0.0)))
        running = set(getattr(worker, "active", ()))  # re-driven when the actor goes...
        finished = getattr(worker, "num_finished", 0)
        with cluster._membership:
            if is_prefill and cluster.config.mode != "colocated":
                _rebuild_without(cluster, worker)
            else:
                _stop(worker)
        left = _not_finished_there(worker, running, finished) if running else 0
    finally:
        cluster.draining.pop(worker_id, None)
    if not is_prefill and cluster.migrations.available:
        cluster.migrations.fell_back(left)
    report = DrainReport(worker_id, idle, left, time.monotonic() - t0, moved)
    cluster._progress(f"drained {worker_id} in {report.seconds:.1f}s" + (
        f" ({moved} requests moved with their KV)" if moved else "") + (
        "" if idle else f" ({report.redriven} requests still running were re-driven)"))
    return report


def _move_off(cluster: Cluster, worker) -> int:
    """Move the decode worker's requests to the others; returns how many moved, once
    the worker has released each (bounded): they are not counted as still running there."""
    moved = {r.request_id for r in cluster.migrations.move_off(worker) if r.outcome == "migrated"}
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while worker.active & moved and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return len(moved)


def _wait_idle(worker, deadline: float) -> bool:
    """Whether the worker ran out of requests before ``deadline``."""
    quiet = 0
    while time.monotonic() < deadline:
        try:
            load = ray.get(worker.actor.load.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - it died: its requests are re-driven
            log.warning("%s stopped answering while it drained: %s", worker.worker_id, e)
            return False
        busy = bool(getattr(worker, "active", None)) or any(
            load.get(k) for k in ("request_ids", "running", "waiting", "queued_prefill_tokens"))
        quiet = 0 if busy else quiet + 1
        if quiet >= 2:
            return True
        time.sleep(POLL_S)
    return False


def _not_finished_there(worker, running: set[str], finished_before: int) -> int:
    """How many of ``running`` did not end on the stopped ``worker`` (...unless their
    last token was out already): waits, bounded, until the gateway's streams have all
    seen the actor go."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while worker.active & running and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return max(0, len(running) - (worker.num_finished - finished_before))


def _stop(worker) -> None:
    """The actor exits: engine loop stopped, transfer group left, process gone."""
    with contextlib.suppress(Exception):
        ray.get(worker.actor.shutdown.remote(), timeout=10)
    with contextlib.suppress(Exception):
        ray.kill(worker.actor, no_restart=True)


def _rebuild_without(cluster: Cluster, worker) -> None:
    """A prefill worker leaves: the decode workers receive from every prefill rank, so
    the transfer group is built again over the workers that stay."""
    cluster._serving.clear()  # new requests wait (bounded) for the new group
    try:
        _stop(worker)
        live = cluster.prefill + cluster.decode
        ray.get([w.actor.leave_transfer_group.remote() for w in live], timeout=GROUP_TIMEOUT_S)
        cluster._connect(GROUP_TIMEOUT_S)
        cluster.rebuilds += 1
    finally:
        cluster.refresh_loads_now()
        cluster._serving.set()
