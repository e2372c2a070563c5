"""The engine loop under failures: a step that raises fails only its requests, every
command resolves, and load is read from the snapshot the loop publishes."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from tandem.engine.engine import EngineOutput
from tandem.engine.engine_loop import EngineLoop, EngineLoopStopped


class _Seq:
    def __init__(self, seq_id: str) -> None:
        self.seq_id = seq_id


class _Scheduler:
    def __init__(self) -> None:
        self.running: list[_Seq] = []
        self.waiting: list[_Seq] = []


class FakeEngine:
    """Each step emits one token per running request; a request named ``bad*`` raises."""

    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.aborted: list[str] = []
        self.snapshots = 0

    def add(self, rid: str) -> None:
        self.scheduler.running.append(_Seq(rid))

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running)

    def step(self, on_layer_done=None) -> list[EngineOutput]:
        ids = [s.seq_id for s in self.scheduler.running]
        if any(r.startswith("bad") for r in ids):
            raise RuntimeError("NaN in the logits")
        self.scheduler.running = []
        return [EngineOutput(r, [1], True, None, 1, 1, 0) for r in ids]

    def abort(self, rid: str) -> EngineOutput:
        self.aborted.append(rid)
        self.scheduler.running = [s for s in self.scheduler.running if s.seq_id != rid]
        return EngineOutput(rid, [], True, None, 1, 0, 0)

    def load_snapshot(self) -> dict:
        self.snapshots += 1
        return {"running": len(self.scheduler.running), "thread": threading.get_ident()}


def _stream(loop: EngineLoop, rid: str) -> Future:
    fut: Future = Future()
    loop.open_stream(rid, lambda out: fut.done() or fut.set_result(out),
                     lambda exc: fut.done() or fut.set_exception(exc))
    return fut


def test_a_step_that_raises_fails_its_requests_and_the_loop_serves_on():
    engine = FakeEngine()
    loop = EngineLoop(engine)
    try:
        bad = _stream(loop, "bad-1")
        loop.call(lambda e: e.add("bad-1"))
        with pytest.raises(RuntimeError, match="NaN"):
            bad.result(10)
        assert engine.aborted == ["bad-1"] and loop.alive and loop.failed_steps == 1
        good = _stream(loop, "good-1")
        loop.call(lambda e: e.add("good-1"))
        assert good.result(10).new_token_ids == [1]
        assert loop.call(lambda e: 42) == 42  # commands still run
        assert loop.snapshot["thread"] == loop._thread.ident  # published by the loop thread
    finally:
        loop.stop()


def test_a_failed_request_without_an_error_sink_still_ends_its_stream():
    engine = FakeEngine()
    loop = EngineLoop(engine)
    try:
        got: Future = Future()
        loop.open_stream("bad-2", got.set_result)
        loop.call(lambda e: e.add("bad-2"))
        out = got.result(10)
        assert out.finished and out.new_token_ids == []
    finally:
        loop.stop()


def test_commands_queued_at_or_after_stop_resolve_with_an_error():
    engine = FakeEngine()
    loop = EngineLoop(engine)
    gate, inside = threading.Event(), threading.Event()
    blocker = loop.submit(lambda e: inside.set() or gate.wait(10))  # holds the loop in a command
    assert inside.wait(10)
    queued = loop.submit(lambda e: "never runs")
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    gate.set()
    stopper.join(20)
    assert blocker.result(10) is True
    assert queued.done()  # run before the loop stopped, or failed with EngineLoopStopped
    with pytest.raises(EngineLoopStopped):
        loop.submit(lambda e: 1).result(1)
    assert not loop.alive


def test_open_streams_end_with_an_error_when_the_loop_stops():
    engine = FakeEngine()
    loop = EngineLoop(engine)
    waiting = _stream(loop, "quiet")  # a request that never produces anything
    loop.stop()
    with pytest.raises(EngineLoopStopped):
        waiting.result(10)


def test_between_steps_runs_on_the_loop_thread_before_every_step_and_while_idle():
    engine = FakeEngine()
    loop = EngineLoop(engine)
    seen: list[tuple[int, int]] = []  # (running requests when called, calling thread)
    try:
        loop.between_steps = lambda e: seen.append((len(e.scheduler.running), threading.get_ident()))
        out = _stream(loop, "a")
        loop.call(lambda e: e.add("a"))
        assert out.result(timeout=5).new_token_ids == [1]
        loop.call(lambda e: None, timeout=5)  # a round later: idle calls too
    finally:
        loop.stop()
    assert (1, loop._thread.ident) in seen  # right before the step that ran "a"
    assert {thread for _, thread in seen} == {loop._thread.ident}
    assert seen[-1][0] == 0
