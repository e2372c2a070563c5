"""Progress of long work on a terminal (tqdm bars on stderr), and nothing at all elsewhere.

The one rule: bars and spinners are drawn only when ``sys.stderr`` is a TTY. In CI logs,
pipes and tests they write nothing, and :func:`progress` hands the iterable back as it
is. They go to stderr, so a command's stdout (JSON, tables) stays parseable.

While a bar is shown, lines printed to a terminal's stdout or stderr are written above
the bars instead of through them.

Here in ``engine`` (not ``common``, which may import the standard library only) so that
the engine (GGUF conversion, hub downloads) and every layer above it can use it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

SPINNER_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
ASCII_SPINNER_FRAMES = "|/-\\"  # where the terminal's encoding has no braille
SPINNER_INTERVAL_S = 0.1


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _real(stream: Any) -> Any:
    """The stream under our line redirection (see ``_AboveBars``), if any."""
    return stream.wrapped if isinstance(stream, _AboveBars) else stream


_tqdm: Any = None


def _bar_class() -> Any:
    """tqdm, without its monitor thread (a benchmark may time this process's own CPU) and
    with a thread lock (tqdm's default may create a multiprocessing one)."""
    global _tqdm
    if _tqdm is None:
        from tqdm import tqdm

        class Tqdm(tqdm):
            monitor_interval = 0

        Tqdm.set_lock(threading.RLock())
        _tqdm = Tqdm
    return _tqdm


def enabled() -> bool:
    """Whether progress is shown: stderr is a terminal."""
    return sys.stderr is not None and _isatty(sys.stderr)


class _AboveBars:
    """A terminal stream whose whole lines are written above the bars (cleared, then redrawn)."""

    def __init__(self, wrapped: TextIO, bars: TextIO) -> None:
        self.wrapped, self._bars = wrapped, bars
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            if "\n" not in self._buf:
                return len(text)
            lines, _, self._buf = self._buf.rpartition("\n")
            with _bar_class().external_write_mode(file=self._bars):
                self.wrapped.write(lines + "\n")
                self.wrapped.flush()
        return len(text)

    def flush(self) -> None:
        self.wrapped.flush()  # a partial line waits for its end: it would be drawn over

    def close_buffer(self) -> None:
        with self._lock:
            if self._buf:
                self.wrapped.write(self._buf)
                self.wrapped.flush()
                self._buf = ""

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.wrapped, name)


_redirect_lock = threading.Lock()
_redirect_depth = 0
_redirected: dict[str, _AboveBars] = {}


def _start_redirect(bars: TextIO) -> None:
    global _redirect_depth
    with _redirect_lock:
        _redirect_depth += 1
        if _redirect_depth > 1:
            return
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is not None and not isinstance(stream, _AboveBars) and _isatty(stream):
                _redirected[name] = _AboveBars(stream, bars)
                setattr(sys, name, _redirected[name])


def _stop_redirect() -> None:
    global _redirect_depth
    with _redirect_lock:
        _redirect_depth -= 1
        if _redirect_depth > 0:
            return
        for name, wrapper in _redirected.items():
            wrapper.close_buffer()
            if getattr(sys, name) is wrapper:  # not replaced meanwhile by someone else
                setattr(sys, name, wrapper.wrapped)
        _redirected.clear()


class Bar:
    """A tqdm bar on stderr, or, when progress is not shown, an object that does nothing.

    Use as a context manager (or call :meth:`close`). ``total`` None: a counter with no end.
    ``leave`` None: the finished bar stays only if no other bar was shown above it.
    ``disable``: never shown (e.g. a command's ``--quiet``).
    """

    def __init__(self, total: float | None = None, desc: str | None = None, unit: str = "it",
                 leave: bool | None = None, unit_scale: bool = False, bar_format: str | None = None,
                 disable: bool = False) -> None:
        self._bar: Any = None
        if disable or not enabled():
            return
        stream = _real(sys.stderr)
        _start_redirect(stream)
        try:
            self._bar = _bar_class()(total=total, desc=desc, unit=unit, leave=leave, unit_scale=unit_scale,
                                     bar_format=bar_format, file=stream, dynamic_ncols=True, disable=False)
        except BaseException:
            _stop_redirect()
            raise

    @property
    def shown(self) -> bool:
        """Whether this bar draws anything."""
        return self._bar is not None

    def update(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_count(self, n: float) -> None:
        """Move the bar to ``n`` done (instead of counting by :meth:`update`)."""
        if self._bar is not None and n != self._bar.n:
            self._bar.update(n - self._bar.n)

    def set_description(self, desc: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(desc)

    def set_postfix(self, text: str) -> None:
        """Free text after the counts (refreshes the bar)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            try:
                bar.close()
            finally:
                _stop_redirect()

    def __del__(self) -> None:  # one left open (an exception past its owner) still gives the streams back
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total: float | None = None, desc: str | None = None, unit: str = "it", leave: bool | None = None,
        unit_scale: bool = False, disable: bool = False) -> Bar:
    """A :class:`Bar` (a no-op one when stderr is not a terminal)."""
    return Bar(total, desc, unit, leave, unit_scale, disable=disable)


def progress(iterable: Iterable[T], total: float | None = None, desc: str | None = None, unit: str = "it",
             leave: bool | None = None, disable: bool = False) -> Iterable[T]:
    """``iterable``, counted on a bar as its items are done; when stderr is not a terminal
    (or ``disable``), ``iterable`` itself, untouched. ``total``: default ``len(iterable)``
    where it has one."""
    if disable or not enabled():
        return iterable
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    return _counted(iterable, Bar(total, desc, unit, leave))


def _counted(iterable: Iterable[T], b: Bar) -> Iterator[T]:
    with b:
        for item in iterable:
            yield item
            b.update()


def _can_encode(stream: Any, text: str) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


@contextmanager
def spinner(desc: str) -> Iterator[Bar]:
    """A spinner with ``desc`` and the time elapsed while the block runs (waits whose end
    is not known in advance); cleared at the end. Nothing when stderr is not a terminal.
    The yielded :class:`Bar`'s ``set_postfix`` adds a note (e.g. what has happened so far)."""
    frames = SPINNER_FRAMES if _can_encode(_real(sys.stderr), SPINNER_FRAMES) else ASCII_SPINNER_FRAMES
    b = Bar(desc=f"{frames[0]} {desc}", leave=False, bar_format="{desc} [{elapsed}{postfix}]")
    if not b.shown:
        yield b
        return
    stop = threading.Event()

    def spin() -> None:
        k = 0
        while not stop.wait(SPINNER_INTERVAL_S):
            k += 1
            b.set_description(f"{frames[k % len(frames)]} {desc}")

    thread = threading.Thread(target=spin, name="tandem-spinner", daemon=True)
    thread.start()
    try:
        yield b
    finally:
        stop.set()
        thread.join()
        b.close()
