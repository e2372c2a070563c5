"""One subscriber's token feed from a decode worker: the deltas of all its requests,
batched per engine step.

A gateway streams every request it runs on a worker through one feed (one Ray
streaming call), instead of one Ray object per token per request: each engine
step becomes one item carrying a delta for each of the subscriber's requests
that advanced. The engine thread only appends outputs and, once per batch,
wakes the worker's event loop; deltas are built there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.engine import EngineOutput
from tandem.engine.engine_loop import EngineLoopStopped
from tandem.protocol.request_path import TokenDelta, TokenLogprob


class RequestFailedError(RuntimeError):
    """The engine step running the request raised; the request ended, the worker serves on."""


@dataclass(frozen=True)
class StreamError:
    """A request of the feed failed on the worker: ``error`` is ``RequestFailedError``
    (its step raised) or ``EngineLoopStopped`` (the worker is going away)."""

    request_id: str
    error: BaseException


FeedItem = TokenDelta | StreamError
STALL_TIMEOUT_S = 300.0  # a stream with no new token for this long is failed (wedged engine)


class FeedClosedError(RuntimeError):
    """A request was started on a feed whose subscriber has gone."""


async def within_stall(aw, request_id: str, worker_id: str):
    """``await aw``; a request that waits longer than ``STALL_TIMEOUT_S`` for its next
    output fails with ``RequestFailedError``."""
    try:
        async with asyncio.timeout(STALL_TIMEOUT_S):  # a timer, no task per call: a per-token path
            return await aw
    except TimeoutError:
        raise RequestFailedError(f"{request_id}: no progress on {worker_id} for "
                                 f"{STALL_TIMEOUT_S:g}s") from None


def delta_of(rid: str, outs: list[EngineOutput], index: int,
             include_tokens: bool = True) -> TokenDelta:
    """One delta from a request's consecutive outputs, its first token at output ``index``."""
    tokens = [t for o in outs for t in o.new_token_ids] if include_tokens else []
    last = outs[-1]
    lps = [lp for o in outs for lp in o.new_logprobs]
    return TokenDelta(
        request_id=rid, token_ids=tuple(tokens), index=index, finished=last.finished,
        finish_reason=last.finish_reason if last.finished else None,
        logprobs=tuple(TokenLogprob.of(lp) for lp in lps) if lps and include_tokens else None)


class TokenFeed:
    """The requests of one subscriber and their outputs not yet taken.

    ``add``/``remove`` and :meth:`next_batch` run on the worker's event loop;
    the sinks :meth:`add` returns run on the engine thread.
    """

    def __init__(self, aio: asyncio.AbstractEventLoop, worker_id: str,
                 on_ended: Callable[[str], None]) -> None:
        """``on_ended(request_id)`` is called once the request's last delta or its error is
        taken (the worker closes the engine stream)."""
        self._aio = aio
        self.worker_id = worker_id
        self._on_ended = on_ended
        self._lock = threading.Lock()
        self._pending: list[tuple[str, object, EngineOutput | BaseException]] = []
        self._wake = asyncio.Event()
        # request -> (its stream's key, the output index of its next token)
        self._streams: dict[str, tuple[object, int]] = {}

    @property
    def request_ids(self) -> list[str]:
        return list(self._streams)

    def add(self, request_id: str, index: int):
        """Route ``request_id``'s outputs here, its next token being output ``index``;
        returns ``(on_output, on_error)`` for ``EngineLoop.open_stream``. Events that an
        earlier stream of the same id left pending are not taken for this one."""
        stream = object()
        self._streams[request_id] = (stream, index)
        return ((lambda out: self._push(request_id, stream, out)),
                (lambda exc: self._push(request_id, stream, exc)))

    def remove(self, request_id: str) -> None:
        """Stop routing; outputs of it still pending are dropped."""
        self._streams.pop(request_id, None)

    def _ended(self, request_id: str) -> None:
        self.remove(request_id)
        self._on_ended(request_id)

    def _push(self, request_id: str, stream: object, event: EngineOutput | BaseException) -> None:
        with self._lock:
            first = not self._pending
            self._pending.append((request_id, stream, event))
        if first:  # one wake-up per batch, not per output
            self._aio.call_soon_threadsafe(self._wake.set)

    async def next_batch(self) -> list[FeedItem]:
        """The next non-empty batch: one delta (or error) per request that moved since the
        last batch. A request's finishing delta or error also removes it."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, []
            items = self._items(pending)
            if items:
                return items

    def _items(self, pending: list[tuple[str, object, EngineOutput | BaseException]]
               ) -> list[FeedItem]:
        outs: dict[str, list[EngineOutput]] = {}
        errors: dict[str, BaseException] = {}
        for rid, stream, event in pending:
            current = self._streams.get(rid)
            if current is None or current[0] is not stream or rid in errors:
                continue
            if isinstance(event, BaseException):
                errors[rid] = event
            else:
                outs.setdefault(rid, []).append(event)
        items: list[FeedItem] = []
        for rid, group in outs.items():
            if rid in errors:
                continue
            stream, index = self._streams[rid]
            delta = delta_of(rid, group, index)
            if delta.finished:
                self._ended(rid)
            else:
                self._streams[rid] = (stream, delta.next_index)
            items.append(delta)
        for rid, exc in errors.items():
            self._ended(rid)
            if not isinstance(exc, EngineLoopStopped):
                exc = RequestFailedError(f"{rid} failed on {self.worker_id}: "
                                         f"{type(exc).__name__}: {exc}")
            items.append(StreamError(rid, exc))
        return items


class Feeds:
    """A worker's feeds by subscriber, and the feed each request streams to (the one
    owner of both). ``close_engine_stream(request_id)`` stops the engine loop routing a
    request's outputs (``EngineLoop.close_stream``)."""

    def __init__(self, worker_id: str, close_engine_stream: Callable[[str], None],
                 on_ended: Callable[[str], None] | None = None) -> None:
        """``on_ended(request_id)``: a feed sent the request's last delta or its error."""
        self.worker_id = worker_id
        self._close_engine_stream = close_engine_stream
        self._on_ended = on_ended
        self._by_subscriber: dict[str, TokenFeed] = {}
        self._closed: set[str] = set()  # subscribers gone: a late start is refused
        self._by_request: dict[str, TokenFeed] = {}

    def get(self, subscriber: str) -> TokenFeed:
        """The subscriber's feed, made by whichever of the worker's ``feed`` and ``start``
        comes first; ``FeedClosedError`` once the subscriber has gone."""
        if subscriber in self._closed:
            raise FeedClosedError(f"the feed of {subscriber!r} on {self.worker_id} has closed")
        feed = self._by_subscriber.get(subscriber)
        if feed is None:
            feed = TokenFeed(asyncio.get_running_loop(), self.worker_id, self._ended)
            self._by_subscriber[subscriber] = feed
        return feed

    def attach(self, request_id: str, subscriber: str, index: int):
        """Route the request to the subscriber's feed from output ``index`` on; returns
        ``(on_output, on_error)`` for ``EngineLoop.open_stream``."""
        feed = self.get(subscriber)
        self._by_request[request_id] = feed
        return feed.add(request_id, index)

    def detach(self, request_id: str, drop_pending: bool = True) -> None:
        """No more outputs of the request to its feed; ``drop_pending=False`` lets the
        finishing output already queued there out (the feed forgets it after that)."""
        self._close_engine_stream(request_id)
        feed = self._by_request.pop(request_id, None)
        if feed is not None and drop_pending:
            feed.remove(request_id)

    def drop(self, subscriber: str) -> list[str]:
        """Forget the subscriber's feed (later starts on it are refused); returns the
        requests still on it, for the worker to end."""
        self._closed.add(subscriber)
        feed = self._by_subscriber.pop(subscriber, None)
        return feed.request_ids if feed is not None else []

    def _ended(self, request_id: str) -> None:
        """The feed sent the request's last delta (or its error)."""
        self._close_engine_stream(request_id)
        self._by_request.pop(request_id, None)
        if self._on_ended is not None:
            self._on_ended(request_id)
