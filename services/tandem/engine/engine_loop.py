"""Runs an engine's step loop on its own thread; other threads talk to it by commands.

The engine is single-threaded by design. Workers (Ray actors serving several
calls at once) submit closures with ``submit``/``call`` — they run on the loop
thread between steps — and read each request's outputs from its own sink.

Failure isolation: a step that raises fails the requests it was running (their
error sinks get the exception, their blocks are freed) and the loop goes on
serving the rest. Every submitted command resolves: with its result, its error,
or ``EngineLoopStopped`` once the loop has stopped. Other threads read load from
the snapshot the loop publishes after every step, never from the scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tandem.engine.engine import EngineOutput, LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoopStopped(RuntimeError):
    """The engine loop has stopped; the command was not run."""


class EngineLoop:
    """Owns ``engine`` on a daemon thread; routes each ``EngineOutput`` to its request's sink.

    ``on_request_failed(engine, request_id)`` ends a request whose step raised
    (on the loop thread; default ``engine.abort``), for owners that must order
    the release of a request's blocks after other work (e.g. queued KV sends).
    ``between_steps``, when set (any time: an owner sets it once its own state is
    built), runs as ``between_steps(engine)`` on the loop thread after each round of
    commands, before the next step or idle wait (so at least every 50 ms while idle); it
    must not raise: an exception there stops the loop, as a failure of the loop itself.
    """

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[EngineOutput]], None] | None = None,
                 on_layer_done: Callable[[int, list], None] | None = None,
                 on_request_failed: Callable[[LLMEngine, str], Any] | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, Callable[[EngineOutput], None]] = {}
        self._error_sinks: dict[str, Callable[[BaseException], None]] = {}
        self._on_outputs = on_outputs
        self._on_layer_done = on_layer_done
        self._on_request_failed = on_request_failed or (lambda e, rid: e.abort(rid))
        self.between_steps: Callable[[LLMEngine], None] | None = None
        self._stop = False
        self._closed = threading.Lock()  # held while a command is queued against a live loop
        self.error: BaseException | None = None  # the loop itself died (not one request)
        self.failed_steps = 0
        self.snapshot: dict = engine.load_snapshot()  # replaced (never mutated) by the loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stop and self._thread.is_alive()

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Queue ``fn(engine)`` to run on the loop thread between steps; returns its future
        (failed with ``EngineLoopStopped`` if the loop is not running)."""
        fut: Future = Future()
        with self._closed:
            if not self.alive:
                fut.set_exception(EngineLoopStopped("the engine loop is not running"))
                return fut
            self._commands.put((lambda: fn(self.engine), fut))
        self._wake.set()
        return fut

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0) -> T:
        """Run ``fn(engine)`` on the loop thread and return its result (or raise its error)."""
        return self.submit(fn).result(timeout=timeout)

    def open_stream(self, request_id: str, sink: Callable[[EngineOutput], None],
                    on_error: Callable[[BaseException], None] | None = None) -> None:
        """Have every later output of ``request_id`` passed to ``sink`` (on the loop thread),
        and the exception to ``on_error`` should a step running it raise."""
        self._sinks[request_id] = sink
        if on_error is not None:
            self._error_sinks[request_id] = on_error

    def close_stream(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._error_sinks.pop(request_id, None)

    def stop(self) -> None:
        """Stop after the current step; queued and later commands fail with ``EngineLoopStopped``."""
        with self._closed:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._fail_commands(EngineLoopStopped("the engine loop stopped"))

    def _fail_commands(self, error: BaseException) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # delivered to the caller
                    fut.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                between = self.between_steps
                if between is not None:
                    between(self.engine)
                if not self.engine.has_unfinished():
                    self.snapshot = self.engine.load_snapshot()
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self._step()
                self.snapshot = self.engine.load_snapshot()
        except BaseException as e:  # pragma: no cover - the loop's own machinery failed
            log.exception("engine loop died")
            self.error = e
        finally:
            with self._closed:
                self._stop = True
            stopped = EngineLoopStopped("the engine loop stopped")
            self._fail_commands(stopped)
            for on_error in list(self._error_sinks.values()):  # streams end, none hangs
                on_error(stopped)

    def _step(self) -> None:
        running = [s.seq_id for s in self.engine.scheduler.running]
        waiting = [s.seq_id for s in self.engine.scheduler.waiting]
        try:
            outputs = self.engine.step(self._on_layer_done)
        except Exception as e:  # one bad request (or batch) must not stop the worker
            self.failed_steps += 1
            log.exception("engine step failed; failing the requests it ran")
            self._fail_requests(running + waiting, e)
            return
        self.dispatch(outputs)

    def _fail_requests(self, candidates: list[str], error: BaseException) -> None:
        """End the requests a failed step may have run: those now RUNNING (admitted ones
        included) that were running or waiting before it."""
        sched = self.engine.scheduler
        now_running = {s.seq_id for s in sched.running}
        for rid in candidates:
            if rid not in now_running:
                continue
            out = None
            try:
                out = self._on_request_failed(self.engine, rid)
            except Exception:
                log.exception("could not end failed request %s", rid)
            on_error = self._error_sinks.get(rid)
            if on_error is not None:
                on_error(error)
            elif isinstance(out, EngineOutput):
                self.dispatch([out])  # a stream without an error sink ends with ``abort``

    def dispatch(self, outputs: list[EngineOutput]) -> None:
        """Deliver outputs to their streams (also used for outputs made inside commands)."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
        if self._on_outputs is not None and outputs:
            self._on_outputs(outputs)
