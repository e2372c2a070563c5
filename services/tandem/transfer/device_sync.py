"""Device-side ordering of KV transfer work: streams and events behind one narrow interface.

On CUDA, compute, sends and receives run on different streams and must be
ordered by events, never by host syncs on a stream another peer's work sits on:

* compute runs on a non-blocking stream the worker owns (never the legacy
  default stream, which waits for every blocking stream);
* each layer group's send waits (device-side) for the event recorded on the
  compute stream when that layer's kernels were queued;
* a receive's completion is an event on the channel's stream; the decode step
  waits for it device-side before it reads the blocks;
* blocks are freed and transfers marked done only once such an event has
  completed, observed off the compute thread (``wait_until_done``).

``CudaSync`` implements :class:`DeviceSync` over torch CUDA streams and events;
``CpuSync`` is its synchronous CPU twin (every event is complete when recorded);
``RecordingSync`` logs every operation in order and completes events only when
told, so tests check the ordering on CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

Stream = Any  # torch.cuda.Stream on CUDA; a name (or None) on the CPU twins
Event = Any  # torch.cuda.Event on CUDA; ``HostEvent`` on the CPU twins


class DeviceSync(Protocol):
    """Streams and events of one device."""

    device: torch.device

    def new_stream(self, name: str) -> Stream:
        """A stream of its own for ``name`` (non-blocking on CUDA: it never waits for,
        nor is waited for by, the legacy default stream)."""
        ...

    def current_stream(self) -> Stream:
        """The stream this thread's device work goes to."""
        ...

    def use(self, stream: Stream) -> contextlib.AbstractContextManager:
        """Send this thread's device work to ``stream`` inside the block."""
        ...

    def bind(self, stream: Stream) -> None:
        """Send this thread's device work to ``stream`` from now on (the compute thread)."""
        ...

    def record_event(self, stream: Stream, *, timing: bool = False,
                     interprocess: bool = False) -> Event:
        """An event that completes when the work queued on ``stream`` so far has run."""
        ...

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Device-side: work queued on ``stream`` from now on runs after ``event``."""
        ...

    def event_done(self, event: Event) -> bool:
        """Whether ``event`` has completed (never blocks)."""
        ...

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds between two completed timing events."""
        ...

    def export_event(self, event: Event) -> bytes:
        """A handle another process on the same device opens with ``import_event``
        (the event must be ``interprocess``)."""
        ...

    def import_event(self, handle: bytes) -> Event:
        ...


class CudaSync:
    """:class:`DeviceSync` over torch CUDA streams (torch's pool streams are non-blocking)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"CudaSync needs an indexed CUDA device (cuda:N), got {device}")
        self.device = device
        self._owned: list = []  # cupy streams behind the torch handles

    def new_stream(self, name: str) -> torch.cuda.Stream:
        """A stream of its own: created non-blocking through cupy where installed (torch's
        pool hands its 32 streams out round-robin to any code of the process, so a pool
        stream may be shared with work that waits), else from torch's non-blocking pool."""
        try:
            import cupy
        except ImportError:
            return torch.cuda.Stream(device=self.device)
        with cupy.cuda.Device(self.device.index):
            raw = cupy.cuda.Stream(non_blocking=True)
        self._owned.append(raw)
        return torch.cuda.ExternalStream(raw.ptr, device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def bind(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(stream)

    def record_event(self, stream: torch.cuda.Stream, *, timing: bool = False,
                     interprocess: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing, interprocess=interprocess)
        event.record(stream)
        return event

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def event_done(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def elapsed(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def export_event(self, event: torch.cuda.Event) -> bytes:
        return event.ipc_handle()

    def import_event(self, handle: bytes) -> torch.cuda.Event:
        return torch.cuda.Event.from_ipc_handle(self.device, handle)


@dataclass(eq=False)
class HostEvent:
    """An event of the CPU twins: the host time it was recorded, and whether it completed."""

    stream: Stream
    time: float = field(default_factory=time.perf_counter)
    done: bool = True
    id: int = 0
    timing: bool = False


class CpuSync:
    """The synchronous CPU twin: work runs when issued, so every event is complete."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device

    def new_stream(self, name: str) -> Stream:
        return None

    def current_stream(self) -> Stream:
        return None

    def use(self, stream: Stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def bind(self, stream: Stream) -> None:
        pass

    def record_event(self, stream: Stream, *, timing: bool = False,
                     interprocess: bool = False) -> HostEvent:
        return HostEvent(stream)

    def wait_event(self, stream: Stream, event: HostEvent) -> None:
        pass

    def event_done(self, event: HostEvent) -> bool:
        return True

    def elapsed(self, start: HostEvent, end: HostEvent) -> float:
        return end.time - start.time

    def export_event(self, event: HostEvent) -> bytes:
        return b""

    def import_event(self, handle: bytes) -> HostEvent:
        return HostEvent(None)


class RecordingSync(CpuSync):
    """A CPU fake that logs the order of device operations (tests).

    ``log`` holds tuples shared with whatever else the test records (channel
    sends and receives, compute): ``("record", stream, event id)``, ``("wait",
    stream, event id)``, ``("done", event id)``. Events ``hold`` selects (all with
    ``True``; or a predicate on the event) stay pending until :meth:`complete` (a
    device still running the work); the others complete when recorded.
    """

    def __init__(self, log: list | None = None,
                 hold: bool | Callable[[HostEvent], bool] = False, label: str = "",
                 first_id: int = 1) -> None:
        """``label`` prefixes stream names and ``first_id`` numbers events, so several
        fakes (one per worker) can share one log."""
        super().__init__()
        self.log: list = [] if log is None else log
        self.hold, self.label = hold, label
        self._ids = itertools.count(first_id)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.events: list[HostEvent] = []

    def new_stream(self, name: str) -> str:
        return self.label + name

    def current_stream(self) -> Stream:
        return getattr(self._local, "stream", self.label + "default")

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        before = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def bind(self, stream: Stream) -> None:
        self._local.stream = stream

    def note(self, *entry: object) -> None:
        with self._lock:
            self.log.append(entry)

    def record_event(self, stream: Stream, *, timing: bool = False,
                     interprocess: bool = False) -> HostEvent:
        with self._lock:
            event = HostEvent(stream, id=next(self._ids), timing=timing)
            event.done = not (self.hold(event) if callable(self.hold) else self.hold)
            self.events.append(event)
            self.log.append(("record", stream, event.id))
        return event

    def wait_event(self, stream: Stream, event: HostEvent) -> None:
        self.note("wait", stream, event.id)

    def event_done(self, event: HostEvent) -> bool:
        return event.done

    def complete(self, event: HostEvent | None = None) -> None:
        """Complete ``event`` (and every earlier event of its stream), or all events."""
        with self._lock:
            for e in self.events:
                if not e.done and (event is None or (e.stream == event.stream
                                                     and e.id <= event.id)):
                    e.done = True
                    self.log.append(("done", e.id))

    def export_event(self, event: HostEvent) -> bytes:
        return event.id.to_bytes(8, "little")

    def import_event(self, handle: bytes) -> HostEvent:
        wanted = int.from_bytes(handle, "little")
        with self._lock:
            return next(e for e in self.events if e.id == wanted)


def make_sync(device: torch.device) -> DeviceSync:
    """``CudaSync`` for a CUDA device (index resolved to the current one), else ``CpuSync``."""
    if device.type == "cuda":
        return CudaSync(torch.device("cuda", device.index if device.index is not None
                                     else torch.cuda.current_device()))
    return CpuSync(device)


def wait_until_done(sync: DeviceSync, event: Event, timeout_s: float | None,
                    broken: Callable[[], str | None] = lambda: None,
                    what: str = "device work") -> None:
    """Block this (non-compute) thread until ``event`` completed, polling without holding
    the device: raise ``TimeoutError`` after ``timeout_s`` (None: no deadline) and
    ``ConnectionError`` once ``broken()`` says why the work can never complete."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 20e-6
    while not sync.event_done(event):
        if (why := broken()) is not None:
            raise ConnectionError(f"{what}: {why}")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete within {timeout_s:g}s")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3 if deadline is not None else 10e-3)
