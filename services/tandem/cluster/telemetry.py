"""What ``/ready`` and ``/metrics`` read: a snapshot of the workers the cluster refreshes itself.

A probe or a scrape never asks the workers anything: one background task per event loop
fetches every worker's metric families every ``interval_s``, reads readiness from the
loads the cluster's own refresher keeps current, and keeps the last snapshot. Any number of probes and scrapes cost nothing beyond reading
it, so a scrape storm cannot turn into Ray calls per worker per scrape.

A snapshot older than ``max_age_s`` (the refresher is stuck) reads as not ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Snapshot:
    """The workers as of ``taken_at`` (``time.monotonic()``)."""

    ready: bool
    worker_families: list = field(default_factory=list)
    taken_at: float = 0.0


class ClusterTelemetry:
    """Periodically refreshed readiness and worker metrics of one ``Cluster``."""

    def __init__(self, cluster, interval_s: float = DEFAULT_INTERVAL_S,
                 max_age_s: float | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.cluster = cluster
        self.interval_s = interval_s
        # one refresh may wait up to the per-worker timeout (5 s) on a hung worker
        self.max_age_s = max_age_s if max_age_s is not None else 3 * interval_s + 10.0
        self.refreshes = 0
        self._snapshot: Snapshot | None = None
        self._first: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def snapshot(self) -> Snapshot:
        """The latest snapshot; the first call starts the refresher and waits for one."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self.close()  # a refresher left on another loop
            self._first = asyncio.Event()  # (re)start on this loop; a snapshot is still served
            self._task = loop.create_task(self._run())
        if self._snapshot is None:
            await self._first.wait()
        snap = self._snapshot
        if snap is None:  # the first refresh failed
            return Snapshot(False)
        if time.monotonic() - snap.taken_at > self.max_age_s:
            return Snapshot(False, snap.worker_families, snap.taken_at)
        return snap

    async def _run(self) -> None:
        while True:
            try:
                self._snapshot = await self._take()
                self.refreshes += 1
            except Exception:  # noqa: BLE001 - keep the last snapshot and try again
                log.exception("refreshing the cluster snapshot failed")
            finally:
                self._first.set()
            await asyncio.sleep(self.interval_s)

    async def _take(self) -> Snapshot:
        c = self.cluster  # its refresher keeps every worker's load() current
        pools = [c.decode] + ([c.prefill] if c.prefill else [])
        ready = bool(c.decode) and all(any(w.load().alive for w in pool) for pool in pools)
        families = await c.worker_metric_families()
        return Snapshot(ready, families, time.monotonic())

    def close(self) -> None:
        """Stop refreshing (from any thread)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task_loop = task.get_loop()
            if not task_loop.is_closed():
                task_loop.call_soon_threadsafe(task.cancel)
