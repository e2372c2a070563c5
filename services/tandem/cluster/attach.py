"""Workers that outlive their gateway: named, detached Ray actors a restarted gateway
re-attaches to.

With a deployment name, each worker is the detached actor ``tandem-<name>-<worker id>``
in the ``tandem`` namespace. A gateway starting under that name looks each one up; it
re-attaches to a worker built from the same engine configuration and role (its
identity), after claiming it with a generation one above any gateway before it, so an
older gateway can never take the workers back. A worker with another identity is
replaced. Requests of the previous gateway are aborted on re-attach, and the transfer
group is rebuilt (no model is reloaded).

This needs a Ray cluster that outlives the gateway (``--ray-address``): a Ray the
gateway started itself goes down with it, detached actors included. If the Ray head
(its GCS) is lost, every actor is lost with it (unless the GCS is made fault tolerant
with an external Redis): the next gateway creates the workers anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

import ray

log = logging.getLogger(__name__)
NAMESPACE = "tandem"


class StaleGatewayError(RuntimeError):
    """A newer gateway has claimed the workers of this deployment."""


def actor_name(deployment: str, worker_id: str) -> str:
    return f"tandem-{deployment}-{worker_id}"


def identity(*parts: object) -> str:
    """What a worker must have been built from to be re-attached (config and role)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def find(deployment: str, worker_id: str):
    """The live detached actor of a worker, or None."""
    try:
        return ray.get_actor(actor_name(deployment, worker_id), namespace=NAMESPACE)
    except ValueError:
        return None


def claim_all(actors: dict[str, object], identities: dict[str, str],
              timeout_s: float) -> dict[str, object]:
    """Claim the found workers for a new generation; returns those re-attached (same
    identity). Raises ``StaleGatewayError`` when a newer gateway holds any of them."""
    alive: dict[str, object] = {}
    generations: dict[str, int] = {}
    for wid, actor in actors.items():
        try:
            generations[wid] = ray.get(actor.owner_generation.remote(), timeout=timeout_s)
            alive[wid] = actor
        except Exception as e:  # dead or unreachable: it will be replaced
            log.warning("cannot re-attach %s: %s", wid, e)
    generation = max(generations.values(), default=0) + 1
    attached = {}
    for wid, actor in alive.items():
        result = ray.get(actor.claim.remote(generation, identities[wid]), timeout=timeout_s)
        if result == "stale":
            raise StaleGatewayError(f"{wid} belongs to a newer gateway")
        if result == "claimed":
            attached[wid] = actor
    return attached


def worker_identity(cluster, worker_id: str) -> str:
    """A worker's identity in ``cluster``: its engine config, id, and the cluster's shape."""
    c = cluster.config
    return identity(cluster.engine_config(worker_id), worker_id, c.mode, c.prefill_workers, c.decode_workers,
                    c.transfer_timeout_s, c.prefill_nice)


def reattach(cluster, n_prefill: int, n_decode: int, timeout_s: float) -> dict[str, object]:
    """The live workers of ``cluster.deployment`` built as this gateway would build them,
    claimed and cleared of the previous gateway's requests; the others are killed."""
    deployment = cluster.deployment
    ids = [f"prefill-{i}" for i in range(n_prefill)] + [f"decode-{i}" for i in range(n_decode)]
    found = {wid: a for wid in ids if (a := find(deployment, wid)) is not None}
    attached = claim_all(found, {w: worker_identity(cluster, w) for w in found}, timeout_s)
    for wid in set(found) - set(attached):
        with contextlib.suppress(Exception):
            ray.kill(found[wid], no_restart=True)
    if attached:
        ray.get([a.abort_all.remote() for a in attached.values()], timeout=timeout_s)
        cluster._progress(f"re-attached {', '.join(sorted(attached))} of {deployment!r}")
    cluster.reattached = sorted(attached)
    return attached


def claim_new(cluster, workers: list, timeout_s: float) -> None:
    """Claim freshly started workers for the generation of the ones re-attached (or 1)."""
    generation = max([ray.get(w.actor.owner_generation.remote(), timeout=timeout_s)
                      for w in cluster.prefill + cluster.decode], default=0) or 1
    ray.get([w.actor.claim.remote(generation, worker_identity(cluster, w.worker_id))
             for w in workers], timeout=timeout_s)
