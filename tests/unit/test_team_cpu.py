"""A step's CPU: the calling thread's and its OpenMP helpers' (``tandem.engine.team_cpu``)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tandem.engine.team_cpu import TeamClock, team_helpers, thread_clock


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_team_of_two_has_one_helper_which_torch_and_the_native_kernels_share(two_threads):
    from tandem.engine.kernels import cpu_kernels

    x = torch.randn(512, 512)
    _ = x @ x  # torch's region starts the team
    helpers = team_helpers(2)
    assert len(helpers) == 1 and threading.get_native_id() not in helpers
    kernels = cpu_kernels.load()
    if kernels is not None:
        kernels.silu_mul(torch.randn(64, 2 * 4096))  # the native kernels' region
    assert team_helpers(2) == helpers  # the same runtime, the same helper
    # one OpenMP runtime in the process: the kernels' library bound to the libgomp torch loaded
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if line.rstrip().rsplit("/", 1)[-1].startswith("libgomp")}
    assert len(runtimes) == 1, runtimes
    assert team_helpers(1) == ()


def _clocks(tids) -> dict[int, float]:
    """The CPU seconds of each of ``tids`` (threads of this process) still alive."""
    out = {}
    for tid in tids:
        try:
            out[tid] = time.clock_gettime(thread_clock(tid))
        except OSError:  # ended
            continue
    return out


def test_the_team_clock_counts_the_helpers_work(two_threads):
    # what the helper's own clock says it spent is in the count (however the runtime split
    # the work, and however busy the machine kept the helper)
    x = torch.randn(1500, 1500)
    _ = x @ x  # the team of two is running
    (helper,) = team_helpers(2)
    clock = TeamClock()
    mark = clock.start()
    helper0 = _clocks([helper])[helper]
    t0 = time.thread_time()
    for _ in range(6):
        _ = x @ x  # split over both threads
    mine = time.thread_time() - t0
    helpers = _clocks([helper])[helper] - helper0
    assert helpers > 0  # the helper did run some of it
    assert clock.since(mark) >= mine + helpers


def test_the_team_clock_is_the_callers_time_on_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clock = TeamClock()
        mark = clock.start()
        t0 = time.thread_time()
        x = torch.randn(800, 800)
        _ = x @ x
        mine = time.thread_time() - t0
        assert mine <= clock.since(mark) <= mine + 0.01
    finally:
        torch.set_num_threads(before)


def test_helpers_that_end_and_start_within_the_work_are_counted():
    # libgomp ends the extra helpers when a smaller team (but more than one thread) starts,
    # and starts new ones for the next larger team: the ids found at the mark change
    before = torch.get_num_threads()
    x = torch.randn(1500, 1500)

    def work() -> None:
        for _ in range(4):
            _ = x @ x

    try:
        torch.set_num_threads(4)
        work()
        clock = TeamClock()
        mark = clock.start()
        first = set(team_helpers(4))
        at_mark = _clocks(int(t) for t in os.listdir("/proc/self/task"))  # every thread's
        t0 = time.thread_time()
        work()
        before_end = _clocks(first)  # the last look at the helpers that end next
        team_helpers(2)  # a team of two: two of the three helpers end
        work()  # a team of four again: two new helpers
        later = set(team_helpers(4))
        assert later != first
        mine = time.thread_time() - t0
        now = _clocks(first | later)
        # all of the work, wherever it ran: each helper's CPU since the mark (a first one's up
        # to its last look where it ended; a new one's all of it)
        helpers = sum(now.get(t, before_end[t]) - at_mark[t] for t in first) + \
            sum(now[t] - at_mark.get(t, 0.0) for t in later - first)
        assert helpers > 0
        assert clock.since(mark) >= mine + helpers
    finally:
        torch.set_num_threads(before)


def test_thread_clock_ids_of_threads_that_do_not_exist_are_refused():
    with pytest.raises(OSError):
        time.clock_gettime(thread_clock(2**22 - 1))
    assert time.clock_gettime(thread_clock(threading.get_native_id())) > 0
