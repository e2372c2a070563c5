"""A drain's report counts the requests that did not end on the stopped worker: one
whose stream finished between the drain's last look and the actor's exit ended in
place, and is not counted as re-driven."""

from __future__ import annotations

import threading
import time
import types

from tandem.cluster import drain


def _worker(active: set[str]):
    return types.SimpleNamespace(active=set(active), num_finished=0)


def test_a_stream_that_finishes_as_the_actor_stops_is_not_counted_as_redriven():
    running = {f"s{i}" for i in range(6)}
    worker = _worker(running)

    def streams_see_the_stop():
        time.sleep(0.2)
        worker.num_finished += 1  # s0's last token was out: it ends on the worker
        worker.active.discard("s0")
        for rid in sorted(running - {"s0"}):  # the rest fail on it; the driver aborts them
            time.sleep(0.02)
            worker.active.discard(rid)

    t = threading.Thread(target=streams_see_the_stop)
    t.start()
    assert drain._not_finished_there(worker, running, finished_before=0) == 5
    assert not worker.active  # it waited for every stream to settle
    t.join()


def test_streams_that_never_settle_count_as_not_finished(monkeypatch):
    monkeypatch.setattr(drain, "SETTLE_TIMEOUT_S", 0.1)
    worker = _worker({"a", "b"})
    assert drain._not_finished_there(worker, {"a", "b"}, finished_before=0) == 2


def test_requests_finished_before_the_snapshot_are_not_subtracted():
    worker = _worker(set())
    worker.num_finished = 7  # earlier streams, all before the drain looked
    assert drain._not_finished_there(worker, {"x"}, finished_before=7) == 1
