"""The router: picks the decode worker first, then the prefill worker, with admission control."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.common.block_hash import prefix_hashes
from tandem.router import decision as reasons
from tandem.router.config import COLOCATED, CONDITIONAL, DISAGGREGATED, RouterConfig
from tandem.router.decision import RouteDecision
from tandem.router.errors import ClusterFullError, NoWorkersError, PromptTooLargeError
from tandem.router.ledger import InflightLedger, Pending
from tandem.router.policy import (decode_score, effective_free_blocks, prefill_cost,
                                    prefill_saturated, queue_length)
from tandem.router.prefix_index import PrefixIndex
from tandem.router.load import BOTH, DECODE, PREFILL, WorkerHandle, WorkerLoad, blocks_for

_Candidate = tuple[WorkerHandle, WorkerLoad]


@dataclass
class _Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    decision: RouteDecision | None = None
    attempts: int = 0


class Router:
    """Places requests on workers; pure Python, no I/O, thread-safe.

    Every routed request is tracked until :meth:`complete` or :meth:`release`
    (call exactly one of them when the request finishes, fails or is aborted;
    both are idempotent). Until a worker's load lists the request, the blocks,
    prefill tokens and queue slot the router sent there are counted on top of
    the load ("promises"), so a burst between two load refreshes is spread
    and bounded correctly.
    """

    def __init__(self, config: RouterConfig | None = None,
                 workers: Iterable[WorkerHandle] = ()) -> None:
        self.config = config or RouterConfig()
        self._lock = threading.RLock()
        self._workers: dict[str, WorkerHandle] = {}
        self._dead: set[str] = set()
        self._indexes: dict[str, PrefixIndex] = {}
        self._ledger = InflightLedger()
        self._requests: dict[str, _Request] = {}
        self._decisions = {r: 0 for r in reasons.REASONS}
        self.retries = 0
        for handle in workers:
            if handle.worker_id in self._workers:
                raise ValueError(f"duplicate worker id {handle.worker_id!r}")
            self.add_worker(handle)

    # -- membership -----------------------------------------------------------------

    def add_worker(self, handle: WorkerHandle) -> None:
        """Add (or replace, by id) a worker; a replacement starts alive with a cold cache."""
        with self._lock:
            wid = handle.worker_id
            self._workers[wid] = handle
            self._dead.discard(wid)
            self._indexes.pop(wid, None)
            self._ledger.drop_worker(wid)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything promised to it."""
        with self._lock:
            self._workers.pop(worker_id, None)
            self._dead.discard(worker_id)
            self._indexes.pop(worker_id, None)
            self._ledger.drop_worker(worker_id)

    def mark_dead(self, worker_id: str) -> None:
        """Stop routing to a worker until it is re-added; drop its promises and cache guess.

        Its requests stay tracked: re-drive them with :meth:`retry` or end them
        with :meth:`release`.
        """
        with self._lock:
            if worker_id in self._workers:
                self._dead.add(worker_id)
            self._indexes.pop(worker_id, None)
            self._ledger.drop_worker(worker_id)

    @property
    def workers(self) -> dict[str, WorkerHandle]:
        """The registered workers by id (a copy)."""
        with self._lock:
            return dict(self._workers)

    # -- routing --------------------------------------------------------------------

    def route(self, request_id: str, prompt_token_ids: Sequence[int],
              max_tokens: int) -> RouteDecision:
        """Choose the decode worker, then the prefill worker (or local prefill).

        Raises ``ClusterFullError`` at once when no decode worker can take the
        request (``NoWorkersError``, a subclass, when none is alive),
        ``PromptTooLargeError`` when no alive decode worker could ever hold the
        prompt, ``ValueError`` for a request id already in flight.
        """
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already routed; use retry()")
            record = _Request(tuple(prompt_token_ids), max_tokens)
            record.decision = self._place(request_id, record.prompt_token_ids, set(), 0)
            self._requests[request_id] = record
            return record.decision

    def retry(self, request_id: str, exclude: Iterable[str] = (), *,
              prompt_token_ids: Sequence[int] | None = None,
              max_tokens: int | None = None, resume: bool = False) -> RouteDecision:
        """Re-drive a tracked request on other workers, chosen anew.

        ``exclude`` names workers not to use this time (e.g. the one that
        failed); dead workers are skipped anyway. For a decode worker that died
        mid-stream, pass the prompt plus the tokens already sent, the tokens
        still to generate, and ``resume=True``: the decode worker prefills them
        itself, and a stream already under way is not refused for want of room
        (the worker queues it until blocks free); only workers too small for it
        are skipped. The old promises are released first; if this raises, the
        request stays tracked without promises (retry again or ``release`` it).
        """
        with self._lock:
            record = self._requests.get(request_id)
            if record is None:
                raise KeyError(f"request {request_id!r} is not in flight")
            if prompt_token_ids is not None:
                if not prompt_token_ids:
                    raise ValueError("prompt_token_ids must not be empty")
                record.prompt_token_ids = tuple(prompt_token_ids)
            if max_tokens is not None:
                record.max_tokens = max_tokens
            self._ledger.drop_request(request_id)
            record.decision = None
            record.attempts += 1
            self.retries += 1
            record.decision = self._place(request_id, record.prompt_token_ids, set(exclude),
                                          record.attempts, resume)
            return record.decision

    def move_target(self, request_id: str, exclude: Iterable[str] = ()) -> WorkerHandle:
        """The decode worker a running request should move to (the rule that places new
        requests, ``exclude`` left out); raises like ``route``."""
        with self._lock:
            record = self._requests.get(request_id)
            if record is None:
                raise KeyError(f"request {request_id!r} is not in flight")
            num_tokens = len(record.prompt_token_ids) + 1
            return self._pick_decode(self._snapshots(set(exclude)), num_tokens)[0]

    def moved(self, request_id: str, decode: WorkerHandle) -> None:
        """The request now decodes on ``decode`` (it moved there with its KV)."""
        with self._lock:
            record = self._requests.get(request_id)
            if record is None or record.decision is None:
                return
            self._ledger.drop_request(request_id)
            record.decision = dataclasses.replace(record.decision, decode=decode, prefill=None)

    def decode_of(self, request_id: str) -> WorkerHandle | None:
        """The decode worker the request runs on now (None: not in flight)."""
        with self._lock:
            record = self._requests.get(request_id)
            return None if record is None or record.decision is None else record.decision.decode

    def prefill_done(self, request_id: str) -> None:
        """The prompt is prefilled (token #1 is out): stop counting its prefill tokens."""
        with self._lock:
            record = self._requests.get(request_id)
            if record is None or record.decision is None:
                return
            d = record.decision
            if d.prefill is not None:
                self._ledger.drop(request_id, d.prefill.worker_id)
            else:
                self._ledger.drop_tokens(request_id, d.decode.worker_id)

    def complete(self, request_id: str) -> bool:
        """The request finished: forget it. Returns whether it was tracked."""
        return self.release(request_id)

    def release(self, request_id: str) -> bool:
        """The request failed or was aborted: forget it. Returns whether it was tracked."""
        with self._lock:
            self._ledger.drop_request(request_id)
            return self._requests.pop(request_id, None) is not None

    # -- introspection --------------------------------------------------------------

    @property
    def decisions(self) -> dict[str, int]:
        """Routing decisions so far by reason (retries included), a copy."""
        with self._lock:
            return dict(self._decisions)

    def in_flight(self) -> int:
        """Requests routed and not yet completed or released."""
        with self._lock:
            return len(self._requests)

    def pending_summary(self) -> dict[str, int]:
        """Tracked requests and the sums of open promises; all zero when idle."""
        with self._lock:
            t = self._ledger.totals()
            return {"requests": len(self._requests),
                    "promised_requests": self._ledger.num_requests(),
                    "workers": self._ledger.num_workers(),
                    "blocks": t.blocks, "tokens": t.tokens, "queued": t.queued}

    # -- internals ------------------------------------------------------------------

    def _snapshots(self, exclude: set[str]) -> list[_Candidate]:
        out = []
        for wid in sorted(self._workers):
            if wid in self._dead:
                continue
            handle = self._workers[wid]
            load = handle.load()
            self._ledger.observe(load)
            if load.alive and wid not in exclude:
                out.append((handle, load))
        return out

    def _place(self, request_id: str, prompt: tuple[int, ...], exclude: set[str],
               attempt: int, resume: bool = False) -> RouteDecision:
        cfg = self.config
        alive = self._snapshots(exclude)
        decode, need = self._pick_decode(alive, len(prompt), resume)
        hashes = prefix_hashes(prompt, cfg.block_size)
        if resume:
            prefill, reason = None, reasons.LOCAL_RESUME
        else:
            prefill, reason = self._pick_prefill(alive, prompt, hashes)
        doer = prefill if prefill is not None else decode
        hits = self._hits(doer.worker_id, hashes, len(prompt))
        tokens = len(prompt) - hits * cfg.block_size
        self._ledger.add(request_id, decode.worker_id, blocks=need,
                         tokens=0 if prefill is not None else tokens)
        if prefill is not None:
            self._ledger.add(request_id, prefill.worker_id, blocks=0, tokens=tokens)
        index = self._indexes.get(doer.worker_id)
        if index is None:
            index = self._indexes[doer.worker_id] = PrefixIndex(cfg.prefix_cache_blocks)
        index.insert(hashes)
        self._decisions[reason] += 1
        return RouteDecision(request_id, decode, prefill, reason, hits, attempt)

    def _hits(self, worker_id: str, hashes: list[bytes], num_tokens: int) -> int:
        """Leading prompt blocks a worker likely caches (at least one token is recomputed)."""
        index = self._indexes.get(worker_id)
        if index is None:
            return 0
        return min(index.hits(hashes), (num_tokens - 1) // self.config.block_size)

    def _pick_decode(self, alive: list[_Candidate], num_tokens: int,
                     resume: bool = False) -> tuple[WorkerHandle, int]:
        """The best decode worker with room, and the blocks the prompt needs on it.
        ``resume``: when none has room, the best one large enough (it queues the stream)."""
        cfg = self.config
        roles = (BOTH,) if cfg.mode == COLOCATED else (DECODE, BOTH)
        pool = [c for c in alive if c[0].role in roles]
        if not pool:
            raise NoWorkersError(f"no alive {'/'.join(roles)} worker to take the request",
                                 cfg.retry_after_s)
        need = {h.worker_id: blocks_for(num_tokens + 1, load.block_size) for h, load in pool}
        if not any(load.total_blocks >= need[h.worker_id] for h, load in pool):
            largest = max(load.total_blocks for _, load in pool)
            raise PromptTooLargeError(
                f"a prompt of {num_tokens} tokens does not fit any decode worker's KV cache "
                f"(largest: {largest} blocks)")
        no_room = no_queue = 0
        eligible = []
        for h, load in pool:
            pending = self._ledger.pending(h.worker_id)
            if effective_free_blocks(load, pending) < need[h.worker_id]:
                no_room += 1
            elif queue_length(load, pending) >= cfg.max_queued_requests:
                no_queue += 1
            else:
                eligible.append((h, load, pending))
        if not eligible and resume:
            eligible = [(h, load, self._ledger.pending(h.worker_id)) for h, load in pool
                        if load.total_blocks >= need[h.worker_id]]
        if not eligible:
            raise ClusterFullError(
                f"all {len(pool)} decode workers are full ({no_room} without free KV blocks "
                f"for {num_tokens} tokens, {no_queue} with {cfg.max_queued_requests} queued "
                f"requests)", cfg.retry_after_s)
        largest = max(load.total_blocks for _, load, _ in eligible)
        best = min(eligible, key=lambda c: (-decode_score(c[1], c[2], largest, cfg),
                                            c[0].worker_id))
        return best[0], need[best[0].worker_id]

    def _pick_prefill(self, alive: list[_Candidate], prompt: tuple[int, ...],
                      hashes: list[bytes]) -> tuple[WorkerHandle | None, str]:
        """The prefill worker (``None``: the decode worker prefills) and the reason."""
        cfg = self.config
        if cfg.mode == COLOCATED:
            return None, reasons.COLOCATED
        if cfg.mode == CONDITIONAL and len(prompt) < cfg.local_prefill_threshold:
            return None, reasons.LOCAL_SHORT_PROMPT
        pool = [(h, load, self._ledger.pending(h.worker_id)) for h, load in alive
                if h.role == PREFILL
                and load.total_blocks >= blocks_for(len(prompt), load.block_size)]
        if not pool:
            if cfg.mode == DISAGGREGATED and not cfg.local_prefill_fallback:
                raise NoWorkersError("no alive prefill worker", cfg.retry_after_s)
            return None, reasons.LOCAL_PREFILL_UNAVAILABLE
        open_ = [c for c in pool if queue_length(c[1], c[2]) < cfg.max_queued_requests]
        if cfg.mode == CONDITIONAL and all(prefill_saturated(load, p, cfg)
                                           for _, load, p in open_):
            return None, reasons.LOCAL_PREFILL_SATURATED
        if not open_:
            raise ClusterFullError(f"all {len(pool)} prefill workers have "
                                   f"{cfg.max_queued_requests} queued requests",
                                   cfg.retry_after_s)

        timed = all(load.prefill_tokens_per_s > 0.0 for _, load, _ in open_)

        def cost(c: tuple[WorkerHandle, WorkerLoad, Pending]) -> tuple[float, str]:
            hits = self._hits(c[0].worker_id, hashes, len(prompt))
            return prefill_cost(c[1], c[2], len(prompt), hits, cfg, timed), c[0].worker_id

        return min(open_, key=cost)[0], reasons.REMOTE
