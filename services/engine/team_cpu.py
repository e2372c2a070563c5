"""CPU time of a step's whole OpenMP team: the calling thread's and its helper threads'.

``time.thread_time()`` counts the calling thread alone; a step run on N threads spends the
rest in the helper threads of the OpenMP runtime (one libgomp per process: the native
kernels' library binds to the one torch loaded). ``TeamClock`` finds the helpers a team of
the current torch thread count runs on by running one parallel region through each runtime
loaded (``GOMP_parallel``), in which every thread reports its id, and reads their CPU clocks
by id. A runtime keeps its helpers between regions, so this runs once per calling thread and
thread count, and again if a helper has gone. Where no runtime can be asked, the calling
thread's time is all it counts.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from functools import cache

import torch

log = logging.getLogger(__name__)

_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


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
                            if line.rstrip().rsplit("/", 1)[-1].startswith(("libgomp", "libiomp"))})
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


class TeamClock:
    """CPU seconds of the calling thread and of its OpenMP team's helpers
    (``torch.get_num_threads()`` threads): ``start()`` before the work, ``since(mark)`` after."""

    def __init__(self) -> None:
        self._helpers: dict[tuple[int, int], tuple[int, ...]] = {}  # (caller, threads) -> helper ids

    def start(self) -> tuple[tuple[int, int], float, dict[int, float]]:
        """A mark: the team's key, the calling thread's CPU time and each helper's."""
        key = (threading.get_native_id(), torch.get_num_threads())
        helpers = self._helpers.get(key)
        if helpers is None:
            try:
                helpers = team_helpers(key[1])
            except Exception as e:  # noqa: BLE001 - the count degrades to the caller's time
                log.warning("OpenMP helper threads not found (%s): counting the calling thread only", e)
                helpers = ()
            self._helpers[key] = helpers
        return key, time.thread_time(), self._read(key, helpers)

    def since(self, mark: tuple[tuple[int, int], float, dict[int, float]]) -> float:
        """CPU seconds the calling thread and the helpers of ``mark`` spent since it."""
        key, t0, before = mark
        now = self._read(key, tuple(before))
        return time.thread_time() - t0 + sum(max(0.0, now[t] - before[t]) for t in now)

    def _read(self, key: tuple[int, int], helpers: tuple[int, ...]) -> dict[int, float]:
        out = {}
        for tid in helpers:
            try:
                out[tid] = time.clock_gettime(thread_clock(tid))
            except OSError:  # the helper has gone (its CPU since the mark is lost): find the team again
                self._helpers.pop(key, None)
        return out
