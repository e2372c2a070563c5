"""Rebalancing: running requests move from a decode worker much fuller than another.

Fullness is a worker's KV usage (blocks held / blocks), or its batch's share of its
sequence slots where that is higher. When the fullest live decode worker is at least
``start_gap`` fuller than the emptiest, moves begin, and go on (a few at a time) until
the gap is under ``stop_gap``: the hysteresis that keeps a near-even pool from moving
requests back and forth. Each move takes the request whose move pays most: the most
tokens still to come times the KV it frees (a request about to end is not worth its
copy), among those small enough not to overshoot; a request moved once is left alone
for ``cooldown_s``. The planning is pure (``plan``); ``Rebalancer.tick`` applies it to
the cluster on the load refresher's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.cluster.cluster import Cluster

log = logging.getLogger(__name__)
START_GAP = 0.25
STOP_GAP = 0.10
MAX_IN_FLIGHT = 2
COOLDOWN_S = 10.0
REMAINING_CAP = 1024  # tokens still to come, counted up to this in a move's gain
ROOM_TOKENS = 64  # the destination must have room for the request plus these


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    total_blocks: int
    free_blocks: int
    running: int
    max_num_seqs: int
    block_size: int

    @property
    def fullness(self) -> float:
        kv = 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0
        return max(kv, self.running / self.max_num_seqs if self.max_num_seqs else 0.0)

    def share(self, num_tokens: int) -> float:
        """The fullness a request of ``num_tokens`` tokens accounts for here."""
        blocks = -(-num_tokens // self.block_size)
        return max(blocks / self.total_blocks if self.total_blocks else 0.0,
                   1 / self.max_num_seqs if self.max_num_seqs else 0.0)


@dataclass(frozen=True)
class RequestView:
    request_id: str
    worker_id: str
    num_tokens: int  # its KV now
    remaining: int  # tokens still to come, at most


@dataclass
class Plan:
    """Where the pool stands: ``moves`` to ask for (request id, destination worker id)."""

    active: bool
    gap: float
    moves: list[tuple[str, str]] = field(default_factory=list)


def plan(workers: Sequence[WorkerView], requests: Sequence[RequestView], active: bool,
         in_flight: int, cooling: set[str], start_gap: float = START_GAP,
         stop_gap: float = STOP_GAP, max_in_flight: int = MAX_IN_FLIGHT) -> Plan:
    """The moves to ask for now. ``active``: moving already (then down to ``stop_gap``),
    else only from ``start_gap`` on; ``in_flight``: moves under way; ``cooling``: request
    ids not to move."""
    if len(workers) < 2:
        return Plan(False, 0.0)
    full = max(workers, key=lambda w: (w.fullness, w.worker_id))
    empty = min(workers, key=lambda w: (w.fullness, w.worker_id))
    gap = full.fullness - empty.fullness
    active = gap >= (stop_gap if active else start_gap)
    out = Plan(active, gap)
    if not active or in_flight >= max_in_flight:
        return out
    # only requests whose move does not overshoot: the pool does not swing back
    fits = [r for r in requests if r.worker_id == full.worker_id
            and r.request_id not in cooling and r.remaining > 0
            and empty.share(r.num_tokens + ROOM_TOKENS) <= _room(empty)
            and full.share(r.num_tokens) <= gap / 2]
    fits.sort(key=lambda r: (-min(r.remaining, REMAINING_CAP) * r.num_tokens, r.request_id))
    for r in fits[:max_in_flight - in_flight]:
        out.moves.append((r.request_id, empty.worker_id))
    return out


def _room(w: WorkerView) -> float:
    return w.free_blocks / w.total_blocks if w.total_blocks else 0.0


class Rebalancer:
    """Applies ``plan`` to a cluster's decode pool, once per load refresh."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.active = False
        self.moves_asked = 0
        self._in_flight: list = []  # futures of the moves asked for
        self._moved_at: dict[str, float] = {}

    def tick(self) -> Plan | None:
        c = self.cluster
        if not (c.config.rebalance and c.migrations.available and c.serving):
            return None
        now = time.monotonic()
        self._in_flight = [f for f in self._in_flight if not f.done()]
        self._moved_at = {r: t for r, t in self._moved_at.items() if now - t < COOLDOWN_S}
        workers = [_view(w) for w in c.decode if w.load().alive and w.load().total_blocks]
        requests = [RequestView(f.request_id, f.current.worker_id, f.num_tokens, f.remaining)
                    for f in c.driver.running()]
        p = plan(workers, requests, self.active, len(self._in_flight), set(self._moved_at))
        if p.active != self.active:
            log.info("rebalancing the decode pool %s (fullness gap %.2f)",
                     "begins" if p.active else "ends", p.gap)
        self.active = p.active
        for rid, dst in p.moves:
            try:
                self._in_flight.append(c.migrate(rid, to=dst))
            except Exception as e:  # noqa: BLE001 - it ended, or moves are busy: next tick
                log.debug("rebalancing %s to %s: %s", rid, dst, e)
                continue
            self._moved_at[rid] = now
            self.moves_asked += 1
        return p


def _view(w) -> WorkerView:
    load = w.load()
    return WorkerView(w.worker_id, load.total_blocks, load.free_blocks, load.running,
                      load.max_num_seqs, load.block_size)
