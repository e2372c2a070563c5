"""One HTTP request's generation: its backend requests, detokenized, merged into one stream.

Each choice runs in its own task that consumes ``Backend.generate`` under
``contextlib.aclosing`` and turns its tokens into text with the output processor
(``tandem.text.output_processor``; a stop-string hit closes the backend iterator,
which aborts the request). Events reach the HTTP side
through one queue, together with two sentinels: the request deadline (a timer) and the
client's disconnect (a task that waits on the ASGI ``receive``). Closing a
:class:`Generation` cancels whatever still runs, so every backend iterator is closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from tandem.common.metrics import GatewayMetrics
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.gateway.backend import Backend
from tandem.gateway.errors import APIError, from_backend_error
from tandem.gateway.metrics import CLIENT_CLOSED, ChoiceClock
from tandem.protocol.request_path import TokenDelta, TokenLogprob
from tandem.text.output_processor import OutputProcessor
from tandem.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 5.0  # how long close() waits for cancelled choices to unwind

_TIMEOUT = object()
_DISCONNECTED = object()


class ClientDisconnected(Exception):
    """The HTTP client went away; nothing more can be sent."""


@dataclass(frozen=True)
class ChoiceJob:
    """One backend request: choice ``index`` of the response."""

    index: int
    prompt_token_ids: Sequence[int]
    params: SamplingParams


@dataclass(frozen=True)
class ChoiceEvent:
    """New output of one choice: text safe to send, the tokens it came from, and, on the
    choice's last event, its finish reason (``stop`` or ``length``)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None = None


@dataclass
class ChoiceResult:
    """A whole choice (the non-streaming response)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    _parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The choice's whole text."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, ev: ChoiceEvent) -> None:
        """Append one event of this choice."""
        if ev.text:
            self._parts.append(ev.text)
        self.token_ids += ev.token_ids
        if ev.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(ev.logprobs)
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason


class Generation:
    """The choices of one request as one stream of :class:`ChoiceEvent` s.

    ``await start()`` launches every choice and waits until each has produced its first
    event, so admission errors (429/503/400) surface before any response is sent; it
    raises :class:`APIError` or :class:`ClientDisconnected`. Then ``events()`` (streaming)
    or ``collect()`` (whole choices) raise the same for what happens later. Always
    ``await close()``: it is idempotent and closes every backend iterator.
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer, request_id: str, jobs: Sequence[ChoiceJob], *,
                 timeout_s: float | None = None,
                 receive: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self._backend = backend
        self._tok = tokenizer
        self.request_id = request_id
        self._jobs = list(jobs)
        self._timeout_s = timeout_s
        self._receive = receive
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._buffer: collections.deque[ChoiceEvent] = collections.deque()
        self._open = {j.index for j in self._jobs}
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.completion_tokens = 0
        self._metrics = self.metrics = metrics
        self._arrival = time.monotonic()
        self._in_flight = False

    # ------------------------------------------------------------------ consumer
    async def start(self) -> None:
        """Launch the choices; return once each has started (or raise its error)."""
        loop = asyncio.get_running_loop()
        if self._metrics is not None:
            self._metrics.running.inc()
            self._in_flight = True
        if self._timeout_s is not None:
            self._timer = loop.call_later(self._timeout_s, self._queue.put_nowait, _TIMEOUT)
        if self._receive is not None:
            self._watcher = loop.create_task(self._watch(self._receive))
        self._tasks = [loop.create_task(self._run(job)) for job in self._jobs]
        waiting = {j.index for j in self._jobs}
        while waiting:
            ev = await self._next()
            self._buffer.append(ev)
            waiting.discard(ev.index)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every event, in arrival order, until all choices finished."""
        while self._buffer:
            yield self._buffer.popleft()
        while self._open:
            yield await self._next()

    async def collect(self) -> list[ChoiceResult]:
        """Run to the end; the choices by index."""
        results = {j.index: ChoiceResult(j.index) for j in self._jobs}
        async for ev in self.events():
            results[ev.index].add(ev)
        return [results[i] for i in sorted(results)]

    async def close(self) -> None:
        """Cancel what still runs (aborting its backend request) and wait for it to unwind."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight:
            self._metrics.running.dec()
            self._in_flight = False
        if self._timer is not None:
            self._timer.cancel()
        pending = [t for t in (*self._tasks, self._watcher) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await asyncio.gather(*pending, return_exceptions=True)

    async def _next(self) -> ChoiceEvent:
        item = await self._queue.get()
        if isinstance(item, ChoiceEvent):
            if item.finish_reason is not None:
                self._open.discard(item.index)
            return item
        if item is _TIMEOUT:
            raise APIError(504, f"the request did not finish within its deadline of {self._timeout_s:g} s",
                           code="request_timeout")
        if item is _DISCONNECTED:
            raise ClientDisconnected()
        assert isinstance(item, APIError), item
        raise item

    async def _watch(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self._queue.put_nowait(_DISCONNECTED)
                return

    # ------------------------------------------------------------------ choices
    async def _run(self, job: ChoiceJob) -> None:
        clock = ChoiceClock(self._metrics, self._arrival)
        try:
            final = await self._drive(job, clock)
        except asyncio.CancelledError:
            clock.finished(FinishReason.ABORT.value, CLIENT_CLOSED)
            raise
        except Exception as e:  # noqa: BLE001 - every failure goes to the client as an error
            self._queue.put_nowait(from_backend_error(e))  # counted where it becomes a response
            return
        clock.finished(final.finish_reason, 200, len(job.prompt_token_ids))
        self.completion_tokens += len(final.token_ids)
        self._queue.put_nowait(final)

    async def _drive(self, job: ChoiceJob, clock: ChoiceClock) -> ChoiceEvent:
        proc = OutputProcessor(self._tok, job.params)
        received, first, final = 0, True, None
        stream = self._backend.generate(f"{self.request_id}-{job.index}", list(job.prompt_token_ids), job.params)
        async with contextlib.aclosing(stream):
            async for raw in stream:
                if final is not None:
                    break  # nothing may follow the finishing delta
                delta = raw.after(received)
                if delta is None:
                    continue
                received = delta.next_index
                clock.tokens_out(len(delta.token_ids))
                ev = self._consume(job.index, delta, proc)
                if ev.finish_reason is not None:
                    final = ev
                    if not delta.finished:
                        break  # a stop string: closing the stream aborts the request
                else:
                    self.completion_tokens += len(ev.token_ids)
                    if ev.text or ev.logprobs or first:  # the first event says the request started
                        self._queue.put_nowait(ev)
                        first = False
        if final is None:
            log.warning("backend stream of %s-%d ended without a finish reason", self.request_id, job.index)
            ev = proc.process((), FinishReason.STOP)
            final = ChoiceEvent(job.index, ev.text, (), None, FinishReason.STOP.value)
        return final

    @staticmethod
    def _consume(index: int, delta: TokenDelta, proc: OutputProcessor) -> ChoiceEvent:
        out = proc.process(delta.token_ids, delta.finish_reason, delta.logprobs)
        if out.finish_reason is FinishReason.ABORT:
            raise APIError(503, "the request was aborted by the server", code="aborted",
                           headers={"Retry-After": "1"})
        reason = out.finish_reason.value if out.finish_reason is not None else None
        return ChoiceEvent(index, out.text, out.token_ids, out.logprobs, reason)
