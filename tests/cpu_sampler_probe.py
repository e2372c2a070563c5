"""What ``BackgroundSampler`` counts beside a busy thread of ours and beside a busy process
of someone else's, measured in a process of its own: run as ``python -m
tests.cpu_sampler_probe``, it prints ``{"ours": [...], "theirs": [...]}``, each entry
``(what the sampler counts, the machine's busy cores less ours, the spinner's cores)``.

A process of its own, because a test session's children (a Ray cluster's workers starting
and stopping) are in the sampler's process tree but not in the comparison's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from services.bench.cpu_load import BackgroundSampler, busy_cpu_seconds, process_cpu_seconds


def measure(pid: int) -> tuple[float, float, float]:
    """(what the sampler counts, the machine's busy cores less ours, ``pid``'s cores) over
    the same 1.5 s: whatever else runs meanwhile shows in both of the first two."""
    t0, busy0 = time.monotonic(), busy_cpu_seconds()
    ours0, pid0 = process_cpu_seconds(os.getpid()), process_cpu_seconds(pid)
    sampler = BackgroundSampler(interval_s=0.1).start()
    time.sleep(1.5)
    counted = sampler.stop()
    dt = time.monotonic() - t0
    others = (busy_cpu_seconds() - busy0 - (process_cpu_seconds(os.getpid()) - ours0)) / dt
    return counted, others, (process_cpu_seconds(pid) - pid0) / dt


def with_our_spinner() -> tuple[float, float, float]:
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    spinner.start()  # one of our threads busy on a core
    try:
        return measure(os.getpid())
    finally:
        stop.set()
        spinner.join()


def with_their_spinner() -> tuple[float, float, float]:
    # a busy process outside our tree (the shell exits; its child is reparented away from us)
    pid = int(subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout)
    try:
        return measure(pid)
    finally:
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    print(json.dumps({"ours": [with_our_spinner() for _ in range(3)],
                      "theirs": [with_their_spinner() for _ in range(3)]}))
