"""Moving running requests between decode workers: whom to move where, and the counts.

The gateway's driver runs each move (``router/migration.py``, the worker calls in
``decode/migration.py``); ``Migrations`` picks destinations by the router's placement
rule, asks for the moves and counts how they ended (``tandem_migrations_total``, the
pause clients saw, the KV bytes moved). A drain moves every request off its worker
(``move_off``); operators and tests move one (``Cluster.migrate``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from tandem.common.metrics import migration_metrics
from tandem.router.migration import FAILED, MIGRATED, MoveResult

if TYPE_CHECKING:
    from tandem.cluster.cluster import Cluster
    from tandem.cluster.handles import RayDecode

log = logging.getLogger(__name__)
MOVE_WAIT_S = 60.0  # a move's two phases are bounded each; this covers a request still prefilling


class Migrations:
    """The cluster's moves and their metrics (``registry``, merged into ``/metrics``)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.registry = CollectorRegistry()
        self.metrics = migration_metrics(self.registry)

    @property
    def available(self) -> bool:
        """Whether the decode workers are connected to each other (``kv_migration``)."""
        c = self.cluster
        return bool(c.config.kv_migration) and c.config.mode != "colocated" \
            and c.driver is not None

    def record(self, result: MoveResult) -> None:
        """Count a move that ended (the driver's callback)."""
        self.metrics.moves.labels(result.outcome).inc()
        if result.outcome == MIGRATED:
            self.metrics.pause.observe(result.pause_s or 0.0)
        if result.kv_bytes:
            self.metrics.kv_bytes.inc(result.kv_bytes)

    def fell_back(self, count: int) -> None:
        """``count`` requests whose move failed were re-driven (prefilled again)."""
        if count:
            self.metrics.moves.labels("fell_back").inc(count)

    def migrate(self, request_id: str, to: str | None = None) -> concurrent.futures.Future:
        """Move a running request to the decode worker ``to`` (default: the one the router
        would place it on, its own left out); the future gets its ``MoveResult``.
        Raises ``KeyError`` for a request or worker not known, ``ValueError`` when moves
        are off, ``ClusterFullError`` when no other worker has room."""
        c = self.cluster
        if not self.available:
            raise ValueError("moving requests needs the decode workers connected "
                             "(disaggregated or conditional mode, kv_migration on)")
        src = c.router.decode_of(request_id)
        if src is None:
            raise KeyError(f"request {request_id!r} is not in flight")
        if to is None:
            dst = c.router.move_target(request_id, exclude={src.worker_id})
        else:
            dst = next((w for w in c.decode if w.worker_id == to), None)
            if dst is None:
                raise KeyError(f"no decode worker {to!r} in the cluster")
            if dst is src:
                raise ValueError(f"{request_id} runs on {to} already")
        return c.driver.migrate(request_id, dst).done

    def move_off(self, worker: RayDecode, timeout_s: float = MOVE_WAIT_S) -> list[MoveResult]:
        """Move every request this gateway runs on ``worker`` to the others (it has left
        the router already); returns how each move ended, within ``timeout_s``."""
        if not self.available:
            return []
        futures, results = [], []
        for rid in sorted(worker.active):
            try:
                futures.append(self.migrate(rid))
            except Exception as e:  # noqa: BLE001 - no room elsewhere, or it just ended
                log.info("%s stays on %s: %s", rid, worker.worker_id, e)
                results.append(MoveResult(rid, FAILED, str(e)))
        deadline = time.monotonic() + timeout_s
        for fut in futures:
            try:
                results.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                results.append(MoveResult("?", FAILED, f"no answer within {timeout_s:g}s"))
        return results
