"""The driver's side of a move (``router/migration.py`` ``Follow``) against fake decode
workers whose every migration step can fail, hang, lag or kill its worker.

Whatever happens, the caller's deltas come in order with no token lost or repeated,
and the ``Move``'s ``done`` resolves. A failed or timed-out step rolls back to the
source (``migrate_rollback`` there, the destination aborted by the move's round id);
a source that dies re-raises for the driver to re-drive; a caller that leaves mid-move
aborts the destination; a request that ends on the source during the switch ends as the
source says; a move asked before the request decodes waits for its first token there;
the source is released (``migrate_done``, else an abort) once the destination streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from contextlib import aclosing

import pytest

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.protocol.messages import KVTransferDescriptor, layer_groups
from tandem.protocol.request_path import DecodeRequest, TokenDelta
from tandem.router import migration as mig
from tandem.router.driver import TransferError, WorkerLostError
from tandem.router.migration import FAILED, MIGRATED, Follow, Move

PROMPT = tuple(range(2, 42))  # 40 tokens: two full blocks of 16
TICK = 0.001  # a decode step of the fakes
TIMEOUT_S = 0.03  # each phase of a move, where a step hangs (else never reached)
STEPS = ("migrate_begin", "migrate_in", "send1", "migrate_pause", "migrate_expect", "send2",
         "start")
SRC_STEPS = {"migrate_begin", "send1", "migrate_pause", "send2"}  # the others: destination's


def token(i: int) -> int:
    """Output ``i`` of the request, whichever worker computes it."""
    return 1000 + i


@pytest.fixture(autouse=True)
def long_phases(monkeypatch):
    monkeypatch.setattr(mig, "MIGRATE_TIMEOUT_S", 5.0)  # a slow machine does not time out


@pytest.fixture()
def short_phases(monkeypatch):
    monkeypatch.setattr(mig, "MIGRATE_TIMEOUT_S", TIMEOUT_S)


class Running:
    """A request decoding on a fake worker: a token each tick into its stream's queue
    while ``go`` is set (paused: the tokens queued before are still to be read)."""

    def __init__(self, rid: str, start: int, max_tokens: int) -> None:
        self.rid, self.produced, self.max_tokens = rid, start, max_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.state = "decoding"  # moving, paused, moved, ended
        self.go = asyncio.Event()
        self.go.set()
        self.task = asyncio.ensure_future(self._produce())

    async def _produce(self) -> None:
        while self.produced < self.max_tokens:
            await self.go.wait()
            await asyncio.sleep(TICK)
            if not self.go.is_set():
                continue  # paused meanwhile: no step
            i = self.produced
            self.produced += 1
            done = self.produced == self.max_tokens
            if done:
                self.state = "ended"
            self.queue.put_nowait(TokenDelta(self.rid, (token(i),), i, done,
                                             FinishReason.LENGTH if done else None))

    def end(self, item) -> None:
        self.state = "ended"
        self.go.clear()
        self.task.cancel()
        self.queue.put_nowait(item)


class FakeDecode:
    """``DecodeOps`` of a fake decode worker. ``plan[step]`` (a migration method,
    ``send1``/``send2`` for the two rounds, ``start`` for a moved request's stream):
    ``fail``/``hang``/``die`` before the step runs, ``fail_after``/``hang_after`` once
    it ran (its reply lost or late), a float to lag, or a coroutine function to run."""

    def __init__(self, worker_id: str, rank: int) -> None:
        self.worker_id, self.rank = worker_id, rank
        self.plan: dict[str, object] = {}
        self.calls: list[str] = []
        self.aborts: list[tuple[str, str | None]] = []
        self.running: dict[str, Running] = {}
        self.reserved: dict[str, str] = {}  # rid -> the round id it was reserved under
        self.full = False
        self.dead = False
        self.sends = 0

    def die(self) -> None:
        self.dead = True
        for r in self.running.values():
            r.end(WorkerLostError(self.worker_id, f"{self.worker_id} died"))

    async def _step(self, step: str, run=None):
        self.calls.append(step)
        action = self.plan.get(step)
        if self.dead:
            raise WorkerLostError(self.worker_id, f"{self.worker_id} is dead")
        if action == "die":
            self.die()
            raise WorkerLostError(self.worker_id, f"{self.worker_id} died")
        if action == "fail":
            raise TransferError(f"{step} failed on {self.worker_id}")
        if action == "hang":
            await asyncio.sleep(3600)
        if isinstance(action, float):
            await asyncio.sleep(action)
        if callable(action):
            await action()
        result = run() if run is not None else None
        if action == "fail_after":
            raise TransferError(f"{step} on {self.worker_id}: its reply was lost")
        if action == "hang_after":
            await asyncio.sleep(3600)
        return result

    async def decode(self, req: DecodeRequest):
        rid = req.request_id
        await self._step("start" if req.migrated else "decode")
        if req.migrated and self.reserved.pop(rid, None) is None:
            raise TransferError(f"{rid}: no reservation on {self.worker_id}")
        r = self.running[rid] = Running(rid, len(req.output_token_ids),
                                        req.sampling_params.max_tokens)
        while True:
            item = await r.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def abort(self, request_id: str, transfer_id: str | None = None) -> None:
        self.aborts.append((request_id, transfer_id))
        if self.dead:
            raise WorkerLostError(self.worker_id, "dead")
        self.reserved.pop(request_id, None)
        r = self.running.get(request_id)
        if r is not None and r.state not in ("ended", "moved"):
            r.end(TokenDelta(request_id, (), r.produced, True, FinishReason.ABORT))

    async def migrate(self, method: str, *args):
        rid = args[0]
        r = self.running.get(rid)
        step = method
        if method == "migrate_send":
            self.sends += 1
            step = f"send{self.sends}"

        def moving(*states):
            if r is None or r.state not in states:
                raise TransferError(f"{rid} on {self.worker_id} is "
                                    f"{r.state if r else 'not held'}, not {states}")

        def begin():
            moving("decoding")
            r.state = "moving"
            n = len(PROMPT) + r.produced
            return {"num_tokens": n, "num_full_blocks": (n - 1) // 16}

        def reserve():
            if self.full:
                return None
            tid, num_full = args[4], args[6]
            self.reserved[rid] = tid
            return _desc(rid, tid, range(num_full))

        def pause():
            moving("moving")
            r.state = "paused"
            r.go.clear()
            n = len(PROMPT) + r.produced - 1
            return {"output_token_ids": [token(i) for i in range(r.produced)],
                    "num_computed_tokens": n, "num_blocks": -(-n // 16)}

        def expect():
            if rid not in self.reserved:
                raise TransferError(f"{rid}: no reservation on {self.worker_id}")
            tid, first, num = args[1], args[2], args[3]
            return _desc(rid, tid, range(first, first + num))

        def rollback():
            if r is None or r.state not in ("moving", "paused"):
                return False
            r.state = "decoding"
            r.go.set()
            return True

        def done():
            moving("moving", "paused")
            r.state = "moved"
            r.go.clear()

        run = {"migrate_begin": begin, "migrate_in": reserve, "migrate_pause": pause,
               "migrate_expect": expect, "migrate_rollback": rollback, "migrate_done": done,
               "migrate_send": lambda: moving("moving", "paused") or 4096}[method]
        return await self._step(step, run)


def _desc(rid: str, tid: str, blocks: range) -> KVTransferDescriptor:
    return KVTransferDescriptor(rid, tid, tuple(blocks), layer_groups(2, None), 0, 1, 0)


class Client:
    """The caller of a ``Follow``: reads its deltas, checks their order, asks for the
    move after ``ask_after`` tokens (0: before the stream starts)."""

    def __init__(self, src: FakeDecode, dst: FakeDecode, max_tokens: int = 60,
                 ask_after: int = 3, rid: str = "r", produced: tuple[int, ...] = ()) -> None:
        self.src, self.dst, self.rid = src, dst, rid
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.moves: dict[str, Move] = {}
        self.moved: list = []
        self.follow = Follow(rid, PROMPT, self.params, src,
                             DecodeRequest(rid, PROMPT, self.params, produced), self.moves,
                             lambda *a: self.moved.append(a))
        self.tokens: list[int] = list(produced)
        self.finish_reason = None
        self.error: BaseException | None = None
        self.ask_after = ask_after
        self.move: Move | None = None
        if ask_after == 0:
            self.ask()

    def ask(self) -> Move:
        self.move = self.moves[self.rid] = Move(self.rid, self.dst, transfer_id=f"{self.rid}.m")
        return self.move

    async def read(self, stop_after: int | None = None) -> None:
        async with aclosing(self.follow.deltas()) as deltas:
            try:
                async for delta in deltas:
                    assert delta.index == len(self.tokens), "a delta out of order"
                    self.tokens += delta.token_ids
                    self.finish_reason = delta.finish_reason
                    if self.move is None and len(self.tokens) >= self.ask_after:
                        self.ask()
                    if stop_after is not None and len(self.tokens) >= stop_after:
                        return  # the caller leaves
            except (WorkerLostError, TransferError) as e:  # the driver's re-drive
                self.error = e

    def expected(self) -> list[int]:
        return [token(i) for i in range(len(self.tokens))]

    def all(self) -> list[int]:
        return [token(i) for i in range(self.params.max_tokens)]


def _result(move: Move):
    assert move.done.done(), "the move never resolved"
    return move.done.result()


def _pair():
    return FakeDecode("src", 0), FakeDecode("dst", 1)


async def _settle() -> None:
    await asyncio.sleep(0.01)  # what the fakes queued on the way out


def test_a_move_hands_the_stream_over_with_no_token_lost_or_repeated():
    src, dst = _pair()
    client = Client(src, dst)

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    assert client.tokens == client.all()
    result = _result(client.move)
    assert result.outcome == MIGRATED and result.kv_bytes == 2 * 4096, result
    assert result.pause_s is not None and result.pause_s < 1
    assert src.calls == ["decode", "migrate_begin", "send1", "migrate_pause", "send2",
                         "migrate_done"]
    assert dst.calls == ["migrate_in", "migrate_expect", "start"]
    assert not src.aborts and not dst.aborts
    assert client.follow.current is dst and len(client.moved) == 1


@pytest.mark.parametrize("how", ["fail", "fail_after", "hang", "hang_after"])
@pytest.mark.parametrize("step", STEPS)
def test_a_failed_or_hung_step_rolls_back_to_the_source(step, how, short_phases):
    src, dst = _pair()
    (src if step in SRC_STEPS else dst).plan[step] = how
    client = Client(src, dst)

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    assert client.error is None and client.tokens == client.all()
    result = _result(client.move)
    assert result.outcome == FAILED and result.error, result
    assert "migrate_rollback" in src.calls  # it decodes on at the source
    assert "migrate_done" not in src.calls and not src.aborts
    assert client.follow.current is src and not client.moved
    if step != "migrate_begin":  # the destination was asked: its reservation is undone
        assert ("r", "r.m/1") in dst.aborts, dst.aborts
    else:
        assert not dst.calls
    assert not dst.reserved


@pytest.mark.parametrize("step", ["migrate_begin", "send1", "migrate_pause", "send2",
                                  "stream_in_switch"])
def test_a_source_that_dies_mid_move_is_re_driven(step):
    src, dst = _pair()
    if step == "stream_in_switch":  # its stream fails while the destination starts
        async def die():
            src.die()
            await asyncio.sleep(0.01)
        dst.plan["start"] = die
    else:
        src.plan[step] = "die"
    client = Client(src, dst)

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    assert isinstance(client.error, WorkerLostError) and client.error.worker_id == "src"
    assert client.tokens == client.expected()
    assert _result(client.move).outcome == FAILED
    if step != "migrate_begin":
        assert ("r", "r.m/1") in dst.aborts, dst.aborts
    assert not dst.reserved and "migrate_done" not in src.calls


@pytest.mark.parametrize("step", STEPS)
def test_the_caller_leaving_mid_move_aborts_the_destination(step):
    src, dst = _pair()

    async def main():
        at = asyncio.Event()

        async def hold():  # the step waits here until the caller has left
            at.set()
            await asyncio.sleep(3600)
        (src if step in SRC_STEPS else dst).plan[step] = hold
        client = Client(src, dst)
        reading = asyncio.ensure_future(client.read())
        await asyncio.wait_for(at.wait(), 5)
        reading.cancel()  # the caller left (its task cancelled)
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        await _settle()
        return client
    client = asyncio.run(main())
    assert _result(client.move).outcome == FAILED
    if step != "migrate_begin":
        assert ("r", "r.m/1") in dst.aborts, dst.aborts
    assert "migrate_done" not in src.calls and not dst.reserved
    assert client.tokens == client.expected()


def test_the_caller_closing_the_stream_mid_move_aborts_the_destination():
    src, dst = _pair()
    src.plan["send1"] = 0.015  # the pre-copy is under way as the caller reads on
    client = Client(src, dst, ask_after=1)

    async def main():
        await client.read(stop_after=4)  # it leaves between two deltas, the move pending
        await _settle()
    asyncio.run(main())
    assert _result(client.move).outcome == FAILED
    assert ("r", "r.m/1") in dst.aborts and not dst.reserved


@pytest.mark.parametrize("produced", [(), (token(0), token(1))])
def test_a_move_asked_before_the_request_decodes_waits_for_its_first_token(produced):
    src, dst = _pair()
    src.plan["decode"] = 0.02  # the start (its KV, a local prefill) takes a while
    client = Client(src, dst, ask_after=0, produced=produced)
    order: list[str] = []
    real = src.migrate

    async def migrate(method, *args):
        order.append(f"{method} after {len(client.tokens)} tokens")
        return await real(method, *args)
    src.migrate = migrate

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    assert order[0] == f"migrate_begin after {len(produced) + 1} tokens", order
    assert _result(client.move).outcome == MIGRATED
    assert client.tokens == client.all()


def test_a_move_to_the_worker_it_runs_on_fails_without_touching_it():
    src, _ = _pair()
    client = Client(src, src)

    async def main():
        await client.read()
    asyncio.run(main())
    result = _result(client.move)
    assert result.outcome == FAILED and "already" in result.error
    assert src.calls == ["decode"] and not src.aborts
    assert client.tokens == client.all()


@pytest.mark.parametrize("when", ["migrate_expect", "start"])
def test_a_request_ending_on_the_source_during_the_switch_ends_as_the_source_says(when):
    # the source owns the request until the destination's first token: an abort there
    # meanwhile ends it, and the destination's copy goes
    src, dst = _pair()

    async def abort_on_source():
        await src.abort("r")
        await asyncio.sleep(0.01)
    dst.plan[when] = abort_on_source
    client = Client(src, dst)

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    assert client.finish_reason == FinishReason.ABORT, client.tokens
    assert client.tokens == client.expected() and len(client.tokens) < client.params.max_tokens
    assert _result(client.move).outcome == FAILED
    assert ("r", "r.m/1") in dst.aborts and not dst.reserved
    assert "migrate_done" not in src.calls and client.follow.current is src


def test_a_destination_without_room_leaves_the_request_where_it_is():
    src, dst = _pair()
    dst.full = True
    client = Client(src, dst)

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    result = _result(client.move)
    assert result.outcome == FAILED and "room" in result.error
    assert client.tokens == client.all() and "migrate_rollback" in src.calls


@pytest.mark.parametrize("how", ["fail", "fail_after"])  # never ran, or its reply lost
def test_a_lost_migrate_done_still_frees_the_source(how):
    src, dst = _pair()
    src.plan["migrate_done"] = how
    client = Client(src, dst)

    async def main():
        await client.read()
        await _settle()
    asyncio.run(main())
    assert _result(client.move).outcome == MIGRATED
    assert client.tokens == client.all()
    assert "migrate_done" in src.calls and ("r", None) in src.aborts  # freed there all the same


def test_a_second_move_after_a_failed_one_goes_through():
    src, dst = _pair()
    dst.plan["migrate_expect"] = "fail"
    client = Client(src, dst, max_tokens=100)

    async def main():
        reading = asyncio.ensure_future(client.read())
        while not client.move or not client.move.done.done():
            await asyncio.sleep(0.002)
        first = client.move
        dst.plan.clear()
        dst.sends = src.sends = 0
        client.ask()
        await reading
        await _settle()
        return first
    first = asyncio.run(main())
    assert _result(first).outcome == FAILED and _result(client.move).outcome == MIGRATED
    assert client.tokens == client.all() and client.follow.current is dst


# -- random plans ------------------------------------------------------------------------
ACTIONS = ("ok", "ok", "ok", "fail", "fail_after", "hang", "hang_after", "die", "lag")


@pytest.mark.parametrize("seed", range(3))
def test_random_plans_keep_the_stream_whole_and_resolve_every_move(seed, short_phases):
    rng = random.Random(seed)

    async def walk(n: int):
        src, dst = _pair()
        steps = [s for s in STEPS if rng.random() < 0.4]
        for step in steps:
            action = rng.choice(ACTIONS)
            worker = src if step in SRC_STEPS else dst
            worker.plan[step] = rng.uniform(0.001, 0.01) if action == "lag" else action
        if rng.random() < 0.2:
            src.plan["migrate_done"] = rng.choice(["fail", "fail_after"])
        leave = rng.choice([None, None, None, rng.randrange(2, 40)])
        client = Client(src, dst, max_tokens=rng.randrange(2, 60), ask_after=rng.randrange(4))
        await client.read(stop_after=leave)
        await _settle()
        what = (n, src.plan, dst.plan, leave, client.params.max_tokens, client.ask_after)
        assert client.tokens == client.expected(), what
        if client.move is not None and client.move.task is None:
            client.move.finish(FAILED, "never taken up")  # as the driver's generate does
        if client.move is not None:
            result = _result(client.move)
            asked_dst = "migrate_in" in dst.calls
            if result.outcome == MIGRATED:
                assert "start" in dst.calls and not dst.aborts, what
                assert "migrate_done" in src.calls, what
                assert ("r", None) in src.aborts or src.plan.get("migrate_done") is None, what
            else:
                assert not asked_dst or ("r", "r.m/1") in dst.aborts, what
                assert "migrate_done" not in src.calls, what
                assert client.follow.current is src, what
        src_died = src.dead or isinstance(client.error, WorkerLostError) \
            and client.error.worker_id == "src"
        if client.error is not None:
            assert isinstance(client.error, WorkerLostError), (what, client.error)
            assert client.error.worker_id == ("src" if src_died else "dst"), what
        elif leave is None:
            assert client.tokens == client.all(), what

    async def main():
        for n in range(30):
            await walk(n)
    asyncio.run(main())
