"""The CPU other processes take on this machine while we measure (Linux ``/proc``).

``BackgroundSampler`` reads, a few times a second, the CPU time all CPUs have been busy
(``/proc/stat``) and the CPU time of our own process trees (this process and, e.g., a
``tandem serve`` subprocess with its Ray workers); the difference over the window,
divided by its length, is the "background cores" ``tandem plan`` shares the CPU with:
a profile taken on a busy machine is scaled back to a quiet one with it, and
``tandem plan --validate`` predicts each mix under the background it was measured in.
CPU time, unlike a count of runnable threads at sampling instants, is not biased by our
own threads that run briefly between two reads.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def busy_cpu_seconds() -> float | None:
    """CPU seconds all CPUs have been busy since boot (``/proc/stat``: every state but idle
    and iowait; guest time is already in user); None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (its threads, not its children); None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def process_tree(roots: Iterable[int]) -> set[int]:
    """The live processes ``roots`` and all their descendants."""
    kids = _children()
    todo, seen = list(roots), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += kids.get(pid, [])
    return seen


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and all its live descendants."""
    return sum(process_cpu_seconds(pid) or 0.0 for pid in process_tree([root]))


def wait_until_idle(root: int, max_s: float = 15.0, window_s: float = 0.1,
                    busy_cores: float = 0.05) -> float:
    """Wait until the process tree of ``root`` uses under ``busy_cores`` of CPU over a
    ``window_s`` window (some engines keep polling for a while after a request); at most
    ``max_s``. Returns the seconds waited."""
    t0 = time.monotonic()
    before = tree_cpu_seconds(root)
    while time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        now = tree_cpu_seconds(root)
        if now - before < busy_cores * window_s:
            break
        before = now
    return time.monotonic() - t0


class BackgroundSampler:
    """Mean cores other processes kept busy between ``start`` and ``stop``.

    ``roots()`` names our process trees at each sample (default: this process); the CPU
    time of each of their processes counts from the first sample that sees it, so a
    process that joins our trees later is ours from then on.
    """

    def __init__(self, roots: Callable[[], list[int]] | None = None, interval_s: float = 0.5) -> None:
        self.roots = roots or (lambda: [os.getpid()])
        self.interval_s = interval_s
        self.samples: list[float] = []  # background cores over each interval (signed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ours: dict[int, float] = {}  # pid -> CPU seconds at its last sample
        self._last: tuple[float, float] | None = None  # (monotonic time, busy CPU seconds)
        self._busy_s = self._elapsed_s = 0.0

    def sample(self) -> None:
        """Account the interval since the previous sample (the first one only starts)."""
        now, busy = time.monotonic(), busy_cpu_seconds()
        if busy is None:
            return
        ours = 0.0
        seen: dict[int, float] = {}
        for pid in process_tree(self.roots()):
            cpu = process_cpu_seconds(pid)
            if cpu is not None:
                seen[pid] = cpu
                ours += cpu - self._ours.get(pid, cpu)
        self._ours = seen
        if self._last is not None:
            # signed: /proc/stat and a process's own counters tick apart, so one interval can
            # credit our CPU to others and the next take it back; clamping each interval at 0
            # would keep the first and drop the second (a bias that shows even beside one
            # busy thread of ours). Only the mean is clamped (``stop``).
            dt, others = now - self._last[0], busy - self._last[1] - ours
            if dt > 0:
                self.samples.append(others / dt)
                self._busy_s += others
                self._elapsed_s += dt
        self._last = (now, busy)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> BackgroundSampler:
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="background-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """Stop sampling; the mean cores other processes used (None: no interval measured)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return max(0.0, self._busy_s / self._elapsed_s) if self._elapsed_s else None

    def __enter__(self) -> BackgroundSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
