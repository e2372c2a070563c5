"""In-flight promises: what the router has sent to workers that their load does not show yet."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.load import WorkerLoad


@dataclass
class _Promise:
    blocks: int  # KV blocks the worker will reserve for the request
    tokens: int  # prompt tokens the worker will prefill
    queued: int  # requests added to the worker's queue (0 or 1)


@dataclass(frozen=True)
class Pending:
    """A worker's outstanding promises, summed."""

    blocks: int = 0
    tokens: int = 0
    queued: int = 0


class InflightLedger:
    """Per-worker sums of promises not yet reflected in the worker's reported load.

    A promise ends when the worker's snapshot lists the request in
    ``request_ids`` (:meth:`observe`; from then on the load counts it), or when
    the router forgets it (:meth:`drop_request`, :meth:`drop_worker`,
    :meth:`drop`). Empty sums are deleted, so an idle ledger is empty.
    """

    def __init__(self) -> None:
        self._by_worker: dict[str, dict[str, _Promise]] = {}
        self._by_request: dict[str, set[str]] = {}
        self._sums: dict[str, list[int]] = {}  # worker -> [blocks, tokens, queued]

    def add(self, request_id: str, worker_id: str, *, blocks: int, tokens: int) -> None:
        """Promise ``blocks`` and ``tokens`` (and one queued request) on a worker."""
        assert blocks >= 0 and tokens >= 0
        promises = self._by_worker.setdefault(worker_id, {})
        assert request_id not in promises, "one promise per request and worker"
        promises[request_id] = _Promise(blocks, tokens, 1)
        self._by_request.setdefault(request_id, set()).add(worker_id)
        self._apply(worker_id, blocks, tokens, 1)

    def pending(self, worker_id: str) -> Pending:
        """The sums of a worker's open promises."""
        s = self._sums.get(worker_id)
        return Pending(*s) if s else Pending()

    def observe(self, load: WorkerLoad) -> None:
        """Close the promises that this snapshot already accounts for."""
        promises = self._by_worker.get(load.worker_id)
        if not promises or not load.request_ids:
            return
        for request_id in [r for r in promises if r in load.request_ids]:
            self.drop(request_id, load.worker_id)

    def drop(self, request_id: str, worker_id: str) -> None:
        """Forget one request's promise on one worker (no-op if none)."""
        promises = self._by_worker.get(worker_id)
        if not promises or request_id not in promises:
            return
        p = promises.pop(request_id)
        if not promises:
            del self._by_worker[worker_id]
        workers = self._by_request[request_id]
        workers.discard(worker_id)
        if not workers:
            del self._by_request[request_id]
        self._apply(worker_id, -p.blocks, -p.tokens, -p.queued)

    def drop_tokens(self, request_id: str, worker_id: str) -> None:
        """Forget only the prefill-token part of a promise (the prefill is done)."""
        p = self._by_worker.get(worker_id, {}).get(request_id)
        if p is not None and p.tokens:
            self._apply(worker_id, 0, -p.tokens, 0)
            p.tokens = 0

    def drop_request(self, request_id: str) -> None:
        """Forget every promise of a request."""
        for worker_id in list(self._by_request.get(request_id, ())):
            self.drop(request_id, worker_id)

    def drop_worker(self, worker_id: str) -> None:
        """Forget every promise on a worker (it died or left)."""
        for request_id in list(self._by_worker.get(worker_id, ())):
            self.drop(request_id, worker_id)

    def totals(self) -> Pending:
        """Sums over all workers."""
        b = t = q = 0
        for blocks, tokens, queued in self._sums.values():
            b, t, q = b + blocks, t + tokens, q + queued
        return Pending(b, t, q)

    def num_workers(self) -> int:
        """Workers with an open promise."""
        return len(self._sums)

    def num_requests(self) -> int:
        """Requests with an open promise."""
        return len(self._by_request)

    def _apply(self, worker_id: str, blocks: int, tokens: int, queued: int) -> None:
        s = self._sums.setdefault(worker_id, [0, 0, 0])
        s[0] += blocks
        s[1] += tokens
        s[2] += queued
        assert min(s) >= 0, f"negative pending sums on {worker_id}: {s}"
        if s == [0, 0, 0] and worker_id not in self._by_worker:
            del self._sums[worker_id]
