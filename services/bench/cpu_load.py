"""The CPU load other processes put on this machine while we measure (Linux ``/proc``).

``BackgroundSampler`` samples, a few times a second, the threads the kernel has
runnable (``procs_running`` in ``/proc/stat``) minus the runnable threads of our own
process trees (this process and, e.g., a ``tandem serve`` subprocess with its Ray
workers). The mean is the "background cores" ``tandem plan`` shares the CPU with: a
profile taken on a busy machine is scaled back to a quiet one with it, and
``tandem plan --validate`` predicts each mix under the background it was measured in.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def runnable_threads() -> int | None:
    """Threads runnable on the machine now (``procs_running``); None off Linux."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


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


def own_runnable_threads(roots: Iterable[int]) -> int:
    """Runnable threads (state R) of the processes ``roots`` and all their descendants."""
    count = 0
    for pid in process_tree(roots):
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                if (t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R":
                    count += 1
            except OSError:
                continue
    return count


class BackgroundSampler:
    """Mean runnable threads not ours, sampled every ``interval_s`` between ``start`` and ``stop``.

    ``roots()`` names our process trees at each sample (default: this process).
    """

    def __init__(self, roots: Callable[[], list[int]] | None = None, interval_s: float = 0.5) -> None:
        self.roots = roots or (lambda: [os.getpid()])
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int | None:
        total = runnable_threads()
        if total is None:
            return None
        # the sampling thread itself is runnable and is one of ours
        return max(0, total - own_runnable_threads(self.roots()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            s = self.sample()
            if s is not None:
                self.samples.append(s)

    def start(self) -> BackgroundSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="background-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """Stop sampling; the mean background runnable threads (None: no sample)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else None

    def __enter__(self) -> BackgroundSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
