"""Requests to a running gateway, through the Ray cluster's own key-value store.

Whoever can join the Ray cluster (its token, on a secured cluster) can ask the gateway
to drain workers or resize a pool: ``tandem drain`` / ``tandem scale`` write a request,
the gateway's control watcher runs ``Cluster.drain_worker`` / ``Cluster.scale`` for it
and writes the outcome back. No port is opened for it:
the keys live in the GCS, in the namespace ``tandem``, under the gateway's name (its
``--deployment``, or one of its own, ``gateway-<random>``):

- ``<name>/node/<worker id>``: the Ray node id of each worker (the gateway keeps it
  current; a pod's pre-stop hook finds the workers on its own node there);
- ``<name>/drain/<worker id>``: a request, ``{"timeout_s": S}``;
- ``<name>/drained/<worker id>``: the outcome, ``{"idle", "migrated", "redriven", "seconds"}`` or
  ``{"error": message}``;
- ``<name>/scale/<role>``: a request, ``{"workers": N, "timeout_s", "drain_timeout_s"}``,
  answered at ``<name>/scaled/<role>``: ``{"workers", "added", "drained"}`` or
  ``{"error": message}``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)
NAMESPACE = "tandem"
POLL_S = 0.5
ANSWERS = {"drain": "drained", "scale": "scaled"}


def name_of(deployment: str | None) -> str:
    """The control name of a gateway: its deployment, or one unique to it."""
    return deployment or f"gateway-{uuid.uuid4().hex[:8]}"


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def _key(name: str, kind: str, worker_id: str = "") -> bytes:
    return f"{name}/{kind}/{worker_id}".encode()


def _put(key: bytes, value: object) -> None:
    _kv()._internal_kv_put(key, json.dumps(value).encode(), overwrite=True, namespace=NAMESPACE)


def _get(key: bytes) -> object | None:
    raw = _kv()._internal_kv_get(key, namespace=NAMESPACE)
    return None if raw is None else json.loads(raw)


def _list(name: str, kind: str) -> dict[str, bytes]:
    """``{worker_id: key}`` of one kind of key."""
    prefix = _key(name, kind)
    keys = _kv()._internal_kv_list(prefix, namespace=NAMESPACE)
    return {k[len(prefix):].decode(): k for k in keys}


def _delete(key: bytes) -> None:
    _kv()._internal_kv_del(key, namespace=NAMESPACE)


# -- the gateway's side --------------------------------------------------------------
def publish_nodes(name: str, nodes: dict[str, str]) -> None:
    """Record ``{worker_id: node_id}``; workers no longer listed are forgotten."""
    for wid, key in _list(name, "node").items():
        if wid not in nodes:
            _delete(key)
    for wid, node_id in nodes.items():
        _put(_key(name, "node", wid), node_id)


class ControlWatcher:
    """Runs the requests addressed to one gateway's ``cluster`` (a thread; ``stop()``
    ends it): each in a thread of its own, at most one per key at a time."""

    def __init__(self, name: str, cluster) -> None:
        self.name = name
        self.cluster = cluster
        self._stop = threading.Event()
        self._running: set[tuple[str, str]] = set()
        self._thread = threading.Thread(target=self._run, name="tandem-control", daemon=True)

    def start(self) -> ControlWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            for kind in ("drain", "scale"):
                try:
                    requests = _list(self.name, kind)
                except Exception:  # noqa: BLE001 - the GCS is unreachable for now
                    log.warning("reading %s requests failed; will retry", kind, exc_info=True)
                    continue
                for subject, key in requests.items():
                    if (kind, subject) not in self._running:
                        self._running.add((kind, subject))
                        threading.Thread(target=self._serve, args=(kind, subject, key),
                                         daemon=True, name=f"tandem-{kind}-{subject}").start()

    def _handle(self, kind: str, subject: str, request: dict) -> dict:
        if kind == "drain":
            r = self.cluster.drain_worker(subject, float(request.get("timeout_s", 30.0)))
            return {"idle": r.idle, "migrated": r.migrated, "redriven": r.redriven,
                    "seconds": round(r.seconds, 3)}
        r = self.cluster.scale(subject, int(request["workers"]),
                               float(request.get("timeout_s", 600.0)),
                               float(request.get("drain_timeout_s", 30.0)))
        return {"workers": r.workers, "added": list(r.added), "drained": list(r.drained)}

    def _serve(self, kind: str, subject: str, key: bytes) -> None:
        try:
            outcome = self._handle(kind, subject, _get(key) or {})
        except Exception as e:  # noqa: BLE001 - told to the requester
            outcome = {"error": f"{type(e).__name__}: {e}"}
        try:
            _put(_key(self.name, ANSWERS[kind], subject), outcome)
            _delete(key)
        except Exception:  # noqa: BLE001
            log.exception("answering the %s request for %s failed", kind, subject)
        finally:
            self._running.discard((kind, subject))


# -- the requester's side (``tandem drain``) ---------------------------------------------
def find_workers(worker_ids: Iterable[str] = (), node_id: str | None = None,
                 name: str | None = None) -> list[tuple[str, str]]:
    """``(gateway name, worker id)`` of the named workers, or of every worker on Ray node
    ``node_id``, among all gateways (or gateway ``name``). Raises ``ValueError`` for a
    worker no gateway has, or one that two gateways have (name the deployment)."""
    prefix = b"" if name is None else f"{name}/".encode()
    found: dict[str, list[str]] = {}  # worker id -> gateway names
    for key in _kv()._internal_kv_list(prefix, namespace=NAMESPACE):
        parts = key.decode().split("/", 2)
        if len(parts) != 3:
            continue
        gateway, kind, wid = parts
        if kind == "node" and (node_id is None or _get(key) == node_id):
            found.setdefault(wid, []).append(gateway)
    if node_id is not None:
        return sorted((g, wid) for wid, gs in found.items() for g in gs)
    out = []
    for wid in worker_ids:
        gateways = found.get(wid, [])
        if not gateways:
            raise ValueError(f"no running gateway has a worker {wid!r}")
        if len(gateways) > 1:
            raise ValueError(f"{wid} belongs to several gateways ({', '.join(gateways)}): "
                             "name one with --deployment")
        out.append((gateways[0], wid))
    return out


def request(kind: str, targets: Iterable[tuple[str, str]], body: dict) -> None:
    """Ask gateways for ``kind`` (``drain``: subject a worker id; ``scale``: a pool role)
    of ``(gateway name, subject)`` targets."""
    for name, subject in targets:
        _delete(_key(name, ANSWERS[kind], subject))
        _put(_key(name, kind, subject), body)


def request_drain(targets: Iterable[tuple[str, str]], timeout_s: float) -> None:
    """Ask the gateways to drain ``(gateway name, worker id)`` targets."""
    request("drain", targets, {"timeout_s": timeout_s})


def wait_answers(kind: str, targets: Iterable[tuple[str, str]],
                 deadline: float, answered: Callable[[int, int], None] | None = None) -> dict[str, dict]:
    """``{subject: outcome}`` as the answers arrive, until ``deadline`` (monotonic);
    a request without an answer by then reads ``{"error": "no answer ..."}``.
    ``answered(done, total)``: called at each poll (a command's progress)."""
    pending, out = set(targets), {}
    total = len(pending)
    while pending:
        for name, subject in sorted(pending):
            outcome = _get(_key(name, ANSWERS[kind], subject))
            if outcome is not None:
                out[subject] = outcome
                pending.discard((name, subject))
        if answered is not None:
            answered(len(out), total)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    for name, subject in pending:
        _delete(_key(name, kind, subject))  # not left for a gateway that starts later
        out[subject] = {"error": f"no answer from gateway {name!r} in time (is it running?)"}
    return out


def wait_drained(targets: Iterable[tuple[str, str]], deadline: float,
                 answered: Callable[[int, int], None] | None = None) -> dict[str, dict]:
    return wait_answers("drain", targets, deadline, answered)


def gateway_names() -> list[str]:
    """The names of the running gateways (those that published their workers' nodes)."""
    names = set()
    for key in _kv()._internal_kv_list(b"", namespace=NAMESPACE):
        parts = key.decode().split("/", 2)
        if len(parts) == 3 and parts[1] == "node":
            names.add(parts[0])
    return sorted(names)
