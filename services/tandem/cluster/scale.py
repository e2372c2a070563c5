"""Resizing a pool of a running cluster: the hook an autoscaler drives.

``scale_pool(cluster, "decode", n)`` makes the decode pool ``n`` workers:

- up: new worker actors ask Ray for their pool's resources as at start-up. On a
  KubeRay cluster with the autoscaler on, actors Ray cannot place yet are the demand
  that adds worker pods (up to the group's maxReplicas); the call waits for them (up
  to ``timeout_s``; then the pending actors are dropped, so the demand goes away, and
  ``TimeoutError`` is raised). Once they are up, the transfer group is rebuilt over
  the pools (requests wait for it, bounded; transfers in flight are re-driven) and the
  router starts placing requests on them.
- down: the newest workers are drained one by one (``tandem.cluster.drain``): no
  stream is cut. The pods they leave idle are what the autoscaler removes (after its
  idleTimeoutSeconds, down to minReplicas).

A restarted gateway builds the configured pools again (``--prefill-workers``,
``--decode-workers``): resize those too for a size that lasts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import TYPE_CHECKING

import ray

from tandem.cluster import attach, drain
from tandem.cluster.handles import RayDecode, RayPrefill
from tandem.decode.worker import DecodeWorker
from tandem.prefill.worker import PrefillWorker

if TYPE_CHECKING:
    from tandem.cluster.cluster import Cluster

ROLES = ("prefill", "decode")
ADD_TIMEOUT_S = 600.0  # long enough for an autoscaler to add a pod and the model to load


@dataclasses.dataclass(frozen=True)
class ScaleReport:
    """What a resize did: the workers added and those drained away."""

    role: str
    workers: int
    added: tuple[str, ...] = ()
    drained: tuple[str, ...] = ()


def scale_pool(cluster: Cluster, role: str, workers: int, timeout_s: float = ADD_TIMEOUT_S,
               drain_timeout_s: float = drain.DRAIN_TIMEOUT_S) -> ScaleReport:
    """Make ``cluster``'s ``role`` pool (``prefill`` or ``decode``) ``workers`` strong."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "prefill" and cluster.config.mode == "colocated":
        raise ValueError("a colocated cluster has no prefill pool: scale the decode pool")
    if workers < 1:
        raise ValueError(f"a pool needs at least one worker, got {workers}")
    pool = cluster.prefill if role == "prefill" else cluster.decode
    if workers < len(pool):
        newest = sorted(pool, key=lambda w: _index(w.worker_id), reverse=True)
        gone = [w.worker_id for w in newest[:len(pool) - workers]]
        for wid in gone:
            drain.drain_worker(cluster, wid, drain_timeout_s)
        return ScaleReport(role, workers, drained=tuple(gone))
    if workers > len(pool):
        added = _add(cluster, role, workers - len(pool), timeout_s)
        return ScaleReport(role, workers, added=tuple(added))
    return ScaleReport(role, workers)


def _index(worker_id: str) -> int:
    match = re.search(r"(\d+)$", worker_id)
    return int(match.group(1)) if match else -1


def new_worker_ids(cluster: Cluster, role: str, count: int) -> list[str]:
    """``count`` ids for new ``role`` workers: the lowest numbers no live worker has, a
    draining one included (its id names its metrics and its slot on the decode board)."""
    used = {_index(w.worker_id) for w in cluster.prefill + cluster.decode
            + list(cluster.draining.values()) if w.worker_id.startswith(role)}
    free = (i for i in range(len(used) + count + 1) if i not in used)
    return [f"{role}-{next(free)}" for _ in range(count)]


def _add(cluster: Cluster, role: str, count: int, timeout_s: float) -> list[str]:
    """Start ``count`` workers, wait for them, then bring them into the group and router."""
    prefill = role == "prefill"
    ids = new_worker_ids(cluster, role, count)
    colocated = cluster.config.mode == "colocated"
    cls, handle = (PrefillWorker, RayPrefill) if prefill else (DecodeWorker, RayDecode)
    kind = "prefill" if prefill else ("both" if colocated else "decode")
    new = [handle(cluster._actor(cls, wid), wid, kind) for wid in ids]
    cluster._progress(f"adding {', '.join(ids)} (waiting up to {timeout_s:g}s for room)")
    try:
        ray.get([w.actor.ready.remote() for w in new], timeout=timeout_s)
        if cluster.deployment:
            attach.claim_new(cluster, new, timeout_s)
    except BaseException as e:
        for w in new:  # pending actors are demand for pods: take it back
            with contextlib.suppress(Exception):
                ray.kill(w.actor, no_restart=True)
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise TimeoutError(f"{', '.join(ids)} did not start within {timeout_s:g}s (no node "
                               f"with the {role} pool's resources: raise the worker group's "
                               "maxReplicas, or add nodes)") from None
        raise
    with cluster._membership:
        cluster._locate(new, timeout_s)
        if not colocated:
            cluster._serving.clear()  # requests wait (bounded) for the group with them in it
            try:
                live = cluster.prefill + cluster.decode
                ray.get([w.actor.leave_transfer_group.remote() for w in live],
                        timeout=drain.GROUP_TIMEOUT_S)
                _extend(cluster, prefill, new)
                cluster._connect(drain.GROUP_TIMEOUT_S)
                cluster.rebuilds += 1
            finally:
                cluster.refresh_loads_now()
                cluster._serving.set()
        else:
            _extend(cluster, prefill, new)
            cluster.refresh_loads_now()
        for w in new:
            cluster.router.add_worker(w)
        cluster.publish_placement()
    cluster._progress(f"added {', '.join(ids)}")
    return ids


def _extend(cluster: Cluster, prefill: bool, new: list) -> None:
    if prefill:
        cluster.prefill = cluster.prefill + new
    else:
        cluster.decode = cluster.decode + new
