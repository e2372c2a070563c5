"""Deadlines for blocking channel operations that cannot time out by themselves.

NCCL point-to-point calls (cupy's bindings) block until the peer answers, with
no timeout. A :class:`Watchdog` watches every guarded call's deadline from its
own thread; the first call past its deadline triggers ``on_expire`` once, which
tears the communicator down (the blocked call then fails) and marks the
channel broken so the worker reports not-alive and the cluster rebuilds the
group. Pure Python: testable on CPU with any blocking call.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator


class Watchdog:
    """Calls ``on_expire(what)`` once, when a guarded call outlives its deadline."""

    def __init__(self, on_expire: Callable[[str], None]) -> None:
        self._on_expire = on_expire
        self._deadlines: dict[int, tuple[float, str]] = {}
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.expired: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, timeout_s: float | None) -> Iterator[None]:
        """Watch the body for ``timeout_s`` seconds (None: not watched)."""
        if timeout_s is None:
            yield
            return
        token = next(self._ids)
        with self._cv:
            self._deadlines[token] = (time.monotonic() + timeout_s, what)
            self._cv.notify()
        try:
            yield
        finally:
            with self._cv:
                self._deadlines.pop(token, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._cv:
            while not self._closed and self.expired is None:
                now = time.monotonic()
                due = [w for d, w in self._deadlines.values() if d <= now]
                if due:
                    self.expired = due[0]
                    break
                nearest = min((d for d, _ in self._deadlines.values()), default=None)
                self._cv.wait(None if nearest is None else nearest - now)
        if self.expired is not None:
            self._on_expire(self.expired)
