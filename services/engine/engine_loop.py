"""Runs an engine's step loop on its own thread; other threads talk to it by commands.

The engine is single-threaded by design. Workers (Ray actors serving several
calls at once) submit closures with ``call`` — they run on the loop thread
between steps — and read each request's outputs from its own queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from services.engine.engine import EngineOutput, LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """Owns ``engine`` on a daemon thread; routes each ``EngineOutput`` to its request's queue."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[EngineOutput]], None] | None = None,
                 on_layer_done: Callable[[int, list], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, Callable[[EngineOutput], None]] = {}
        self._on_outputs = on_outputs
        self._on_layer_done = on_layer_done
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Queue ``fn(engine)`` to run on the loop thread between steps; returns its future."""
        fut: Future = Future()
        self._commands.put((lambda: fn(self.engine), fut))
        self._wake.set()
        return fut

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0) -> T:
        """Run ``fn(engine)`` on the loop thread and return its result (or raise its error)."""
        return self.submit(fn).result(timeout=timeout)

    def open_stream(self, request_id: str, sink: Callable[[EngineOutput], None]) -> None:
        """Have every later output of ``request_id`` passed to ``sink`` (on the loop thread)."""
        self._sinks[request_id] = sink

    def close_stream(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

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
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                self.dispatch(self.engine.step(self._on_layer_done))
        except BaseException as e:  # pragma: no cover - surfaced through health checks
            log.exception("engine loop died")
            self.error = e

    def dispatch(self, outputs: list[EngineOutput]) -> None:
        """Deliver outputs to their streams (also used for outputs made inside commands)."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)
        if self._on_outputs is not None and outputs:
            self._on_outputs(outputs)
