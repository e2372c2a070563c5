"""CPU time of a step's whole OpenMP team: the calling thread's and its helper threads'.

``time.thread_time()`` counts the calling thread alone; a step run on N threads spends the
rest in the helper threads of the OpenMP runtime (one libgomp per process: the native
kernels' library binds to the one torch loaded). Those helpers come and go: libgomp ends
the extra ones when a team smaller than its pool (but larger than one) starts, and the
native kernels size each team by its work. So ``TeamClock`` counts the team as the process's
CPU (which keeps the CPU of threads that have ended) less that of the process's other
threads: those alive when it last looked, less the helpers a team of the current thread
count runs on (found by one parallel region through each runtime loaded,
``GOMP_parallel``, in which every thread reports its id). It looks again when the thread
count changes and every ``REFRESH_S``; a thread started since then counts as the team's
until the next look. Where no runtime can be asked, helpers count as other threads, so the
team is the calling thread alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from functools import cache

import torch

log = logging.getLogger(__name__)

REFRESH_S = 10.0  # how often the other threads are listed again
_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_RUNTIMES = ("libgomp", "libiomp", "libomp")  # libraries that take GOMP_parallel


def thread_clock(tid: int) -> int:
    """The CPU clock id of thread ``tid`` of this process (Linux: the kernel's per-thread
    CPUCLOCK_SCHED encoding, as ``pthread_getcpuclockid`` builds it)."""
    return ((~tid) << 3) | 6


@cache
def _runtimes() -> tuple[ctypes.CDLL, ...]:
    """The OpenMP runtimes mapped into this process that take ``GOMP_parallel``."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f
                            if line.rstrip().rsplit("/", 1)[-1].startswith(_RUNTIMES)})
    except OSError:
        return ()
    out = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.GOMP_parallel
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [_REGION, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
        out.append(lib)
    if not out:
        log.warning("no OpenMP runtime found: a step's CPU counts its calling thread only")
    return tuple(out)


def team_helpers(threads: int) -> tuple[int, ...]:
    """Thread ids of the helpers a team of ``threads`` started from the calling thread runs
    on, in every OpenMP runtime loaded (empty for one thread)."""
    if threads < 2:
        return ()
    ids: list[int] = []

    @_REGION
    def report(_: int) -> None:
        ids.append(threading.get_native_id())

    for lib in _runtimes():
        lib.GOMP_parallel(report, None, threads, 0)
    me = threading.get_native_id()
    return tuple(sorted(set(ids) - {me}))


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


class TeamClock:
    """CPU seconds of the calling thread and of its OpenMP team's helpers
    (``torch.get_num_threads()`` threads): ``start()`` before the work, ``since(mark)`` after."""

    def __init__(self) -> None:
        self._others: tuple[int, ...] = ()  # the process's threads outside the team
        self._looked: tuple[int, int, float] | None = None  # (caller, threads, when)

    def start(self) -> tuple[float, dict[int, float]]:
        """A mark: the process's CPU time and each other thread's."""
        me, threads, now = threading.get_native_id(), torch.get_num_threads(), time.monotonic()
        if self._looked is None or self._looked[:2] != (me, threads) or now - self._looked[2] > REFRESH_S:
            self._look(me, threads)
            self._looked = (me, threads, now)
        return time.process_time(), self._read(self._others)

    def since(self, mark: tuple[float, dict[int, float]]) -> float:
        """CPU seconds the calling thread and its helpers spent since ``mark``."""
        cpu0, before = mark
        others = self._read(tuple(before))
        return max(0.0, time.process_time() - cpu0 - sum(others[t] - before[t] for t in others))

    def _look(self, me: int, threads: int) -> None:
        try:
            helpers = set(team_helpers(threads))
        except Exception as e:  # noqa: BLE001 - the count degrades to the caller's time
            log.warning("OpenMP helper threads not found (%s): counting the calling thread only", e)
            helpers = set()
        self._others = tuple(sorted(_thread_ids() - helpers - {me}))

    @staticmethod
    def _read(tids: tuple[int, ...]) -> dict[int, float]:
        out = {}
        for tid in tids:
            try:
                out[tid] = time.clock_gettime(thread_clock(tid))
            except OSError:  # ended: its CPU stays in the process's, so it counts as the team's
                continue
        return out
