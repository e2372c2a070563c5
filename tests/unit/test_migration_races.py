"""Two real DecodeWorkers (tiny model, in process) and the driver's ``Follow`` moving a
running request between them, under random orders of what can happen meanwhile: an
abort on either worker, a client gone on either (its feed dropped), the caller leaving,
a worker shut down, a step failing or hanging (a rollback), the pair of workers losing
each other, and the request finishing on its own, each injected before, after, racing
or (for the KV rounds) in the middle of one step of the move: begin, the destination's
reservation, the pre-copy round, the pause, the last round's reservation, the last
round, the destination's commit, ``migrate_done``.

The workers talk over an in-process channel (``Channel`` of test_decode_release,
extended) that can hold a send or a receive mid-write, fail a header, or lose the pair.
Half the walks call the workers as Ray does (a call the driver stops waiting for runs
on), half cancel them with the driver. After each walk:

- the client's tokens are in order, none lost or repeated, and those of a greedy
  reference (the KV copied bit for bit), all of them when nothing ended the request;
- at no time does the request decode on both workers; once it ended, both hold nothing
  (every block free, no transfer registered, no request held);
- the destination frees its blocks only when no write into them is in flight, and
  nothing is written into them after (they are poisoned at the free and checked);
- the source frees its blocks only when no KV round still reads them, and, when the move
  went through, only after the destination committed;
- the move's ``done`` resolves, and the lifecycle refused only the events of the races
  the design accepts (``EXPECTED_REFUSALS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import queue
import random
import threading
import time
from contextlib import aclosing

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.decode.feed import FeedClosedError, StreamError
from tandem.decode.lifecycle import LIFECYCLE, DecodeState as S
from tandem.decode.migration import MigrationError
from tandem.decode.worker import DecodeWorker, TransferFailedError
from tandem.engine.engine_loop import EngineLoopStopped
from tandem.protocol.request_path import DecodeRequest
from tandem.router import migration as mig
from tandem.router.driver import TransferError, WorkerLostError
from tandem.router.migration import FAILED, MIGRATED, Follow, Move
from tandem.transfer.endpoint import make_receiver, make_sender
from tests.decode_stream import decode_stream
from tests.unit.test_decode_races import _until_free
from tests.unit.test_decode_release import PROMPT, Channel, _all_free

PROMPTS = (tuple(PROMPT), tuple(range(5, 26)), tuple(range(7, 55)))  # 37, 21, 48 tokens
MAX_TOKENS = 32
STAGES = ("begin:before", "begin:after", "begin:racing",
          "in:before", "in:after", "in:racing",
          "send1:during", "recv1:during", "send1:after",
          "pause:before", "pause:after", "pause:racing",
          "expect:before", "expect:racing", "expect:after",
          "send2:during", "recv2:during", "send2:after",
          "start:racing", "start:after", "done:before", "done:after")
EVENTS = ("abort_src", "abort_dst", "gone_src", "gone_dst", "caller_leaves", "fail", "hang",
          "finish", "pair_lost", "shutdown_src", "shutdown_dst", "none")
WALKS = 40  # per seed
SHUTDOWNS = 1  # walks per seed that shut a worker down (each costs a new worker)
STEP_S = 0.002  # added to each engine step
TIMEOUT_S = 0.25  # the driver's phase timeout in these walks
# (state, event) refusals the design accepts, each a race it resolves by refusing:
EXPECTED_REFUSALS = {
    ("RELEASING", "COMMIT"),  # the destination ended while its commit was queued
    ("RELEASING", "MIGRATION_RESERVED"),  # ended while its blocks were being reserved
    ("RELEASING", "REFUSED"),  # ditto, and the reservation failed or found no room
    ("RELEASING", "MIGRATE"),  # the source ended while migrate_begin looked at its blocks
    ("RELEASED", "MIGRATE"),  # ... or finished then
}


class PeerChannel(Channel):
    """``Channel`` between two decode workers (each the other's optional peer), which
    can hold its next send or its next payload receive (a write into the blocks), fail
    its next send, lose the pair (``lost``: the receives and sends of both ends raise),
    and be closed (its receives end)."""

    def __init__(self, rank: int, boxes: dict, lost: set) -> None:
        super().__init__(rank, boxes)
        self.optional = frozenset({1 - rank})
        self._lost = lost
        self.hold_send = self.hold_recv = None  # a gate the next send / receive waits on
        self.send_held, self.recv_held = threading.Event(), threading.Event()
        self.fail_send = False
        self.sends = 0

    def _check(self) -> None:
        if self._lost:
            raise ConnectionError("the pair is lost")

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        gate, self.hold_send = self.hold_send, None
        if gate is not None:
            self.send_held.set()
            gate.wait(10)
            self.send_held.clear()
        if self.fail_send:
            self.fail_send = False
            raise ConnectionError("injected send failure")
        self._check()
        self.sends += 1
        super().send(data, dst_rank)

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        box = self._boxes[(src_rank, self.rank)]
        gate = None if idle else self.hold_recv
        if gate is not None:  # in place, the receiver holds the transfer's lock here
            self.hold_recv = None
            self.recv_held.set()
            gate.wait(10)
            self.recv_held.clear()
        while True:
            self._check()
            try:
                data = box.get(timeout=0.01)
                break
            except queue.Empty:
                continue
        buf.copy_(data)

    def close(self) -> None:
        self._lost.add(self.rank)


def _wire(workers: list[DecodeWorker]) -> list[PeerChannel]:
    """Connect the two workers (ranks 0 and 1) afresh; returns their channels."""
    boxes, lost = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}, set()
    channels = []
    for rank, w in enumerate(workers):
        w.leave_transfer_group()
        ch = PeerChannel(rank, boxes, lost)
        w.receiver = make_receiver(ch, w.engine, [1 - rank])
        w.sender = make_sender(ch, w.engine, w._on_migration_sent, min_run_plane_bytes=1,
                               receivers=[1 - rank])  # in place: writes into the blocks
        w.rank = rank
        channels.append(ch)
    return channels


def _new_worker(model_dir, name: str) -> DecodeWorker:
    return DecodeWorker(name, EngineConfig(model=str(model_dir), cache=CacheConfig(
        num_blocks=32, enable_prefix_caching=False)), transfer_timeout_s=5.0)


@pytest.fixture(scope="module")
def pool(tiny_model_dir):
    """Two workers (a shut-down one is replaced) and each prompt's greedy reference."""
    workers = [_new_worker(tiny_model_dir, "mig-a"), _new_worker(tiny_model_dir, "mig-b")]

    async def reference(prompt):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = []
        async for delta in decode_stream(workers[0], DecodeRequest("ref", prompt, params)):
            tokens += delta.token_ids
        return tokens
    refs = {p: asyncio.run(reference(p)) for p in PROMPTS}
    yield workers, refs, tiny_model_dir
    for w in workers:
        w.shutdown()


@pytest.fixture()
def refusals(monkeypatch):
    """Every lifecycle refusal, as (state, event) names."""
    seen: list[tuple[str, str]] = []
    real = LIFECYCLE.move

    def move(request, event, request_id=""):
        state = request.state
        ok = real(request, event, request_id)
        if not ok:
            seen.append((state.name, event.name))
        return ok
    monkeypatch.setattr(LIFECYCLE, "move", move)
    return seen


class Walk:
    """One request moved from ``src`` to ``dst`` with ``event`` injected at ``stage``."""

    def __init__(self, rng: random.Random, n: int, workers, refs, stage: str, event: str):
        self.rng, self.n = rng, n
        i = rng.randrange(2)
        self.src, self.dst = workers[i], workers[1 - i]
        self.channels = _wire(workers)
        self.ch_src, self.ch_dst = self.channels[self.src.rank], self.channels[self.dst.rank]
        self.rid = f"w{n}"
        self.prompt = rng.choice(PROMPTS)
        self.max_tokens = rng.randrange(4, MAX_TOKENS + 1)
        self.reference = refs[self.prompt][:self.max_tokens]
        self.params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens,
                                     ignore_eos=True)
        self.ask_after = rng.choice([0, 1, 1, 2, 3])  # tokens seen before the move is asked
        self.stage, self.event = stage, event
        self.ray_like = rng.random() < 0.5  # a call the driver stops waiting for runs on
        self.delays = rng.random() < 0.3  # a short sleep before each step
        self.fired = False
        self.down: set[DecodeWorker] = set()  # shut down
        self.sends = 0
        self.tokens: list[int] = []
        self.finish_reason = None
        self.error: BaseException | None = None
        self.violations: list[str] = []
        self.log: list[str] = []  # commit, src_free, in order
        self.poisoned: list[tuple[list[int], torch.Tensor]] = []  # dst blocks at its frees
        self.calls: set[asyncio.Future] = set()  # worker calls run Ray-like
        self.feeds: dict[DecodeWorker, GatewayFeed] = {}
        self.held_at_end: dict[str, str | None] = {}
        self.move: Move | None = None
        self.consumer: asyncio.Future | None = None  # the client's task
        self.hold = threading.Event()  # the gate of a held send or receive

    # -- instrumentation ----------------------------------------------------------------
    def instrument(self) -> None:
        src, dst, rid = self.src, self.dst, self.rid
        real_src_abort, real_dst_abort = src.engine.abort, dst.engine.abort
        real_commit = dst.engine.commit_migrated

        def src_abort(r):
            if r == rid and src.engine.scheduler.get(r) is not None:
                if src._sends or self.ch_src.send_held.is_set():
                    self.violations.append("the source freed its blocks under a KV round")
                self.log.append("src_free")
            return real_src_abort(r)

        def dst_abort(r):
            seq = dst.engine.scheduler.get(r)
            if r != rid or seq is None:
                return real_dst_abort(r)
            if self.ch_dst.recv_held.is_set() or any(
                    not pt.done.is_set() for pt in dst.receiver._pending.values()):
                self.violations.append("the destination freed its blocks under a write")
            blocks = list(seq.block_ids)
            out = real_dst_abort(r)
            kv = dst.engine.kv_cache.kv
            kv[:, :, blocks] = 7.0  # poison: any later write shows
            self.poisoned.append((blocks, kv[:, :, blocks].clone()))
            return out

        def commit(*args):
            ok = real_commit(*args)
            if ok:
                self.log.append("commit")
            return ok

        src.engine.abort, dst.engine.abort = src_abort, dst_abort
        dst.engine.commit_migrated = commit

        def between(engine):  # on each engine thread: never decoding on both
            time.sleep(STEP_S)  # steps slow enough for a move to overlap some
            if all(w.loop.alive for w in (src, dst)) and all(
                    any(s.seq_id == rid for s in list(w.engine.scheduler.running))
                    for w in (src, dst)):
                self.violations.append("decoding on both workers")
        src.loop.between_steps = dst.loop.between_steps = between

    def uninstrument(self) -> None:
        for w in (self.src, self.dst):
            for name in ("abort", "commit_migrated"):
                w.engine.__dict__.pop(name, None)
            w.loop.between_steps = None

    # -- the driver's DecodeOps over the two workers ------------------------------------
    def is_down(self, w) -> bool:
        return w in self.down

    def feed_of(self, w) -> GatewayFeed:
        feed = self.feeds.get(w)
        if feed is None or feed.task.done():
            feed = self.feeds[w] = GatewayFeed(w, f"gw-{self.n}-{w.worker_id}-{id(self)}")
        return feed

    def translate(self, w, e: BaseException) -> BaseException:
        """A worker's error as ``RayDecode`` makes it."""
        if self.is_down(w) or isinstance(e, (EngineLoopStopped, FeedClosedError)):
            return WorkerLostError(w.worker_id, f"{w.worker_id}: {e}")
        if isinstance(e, (MigrationError, TransferFailedError)):
            return TransferError(str(e))
        return e

    async def start(self, w, req: DecodeRequest, subscriber: str):
        """``start`` on the worker; a moved request's through the stages of its commit."""
        if not req.migrated:
            return await w.start(req, subscriber)
        await self.hook(w, "start", "before")
        if self.stage == "start:racing" and not self.fired:
            task = _retrieved(asyncio.ensure_future(w.start(req, subscriber)))
            w.loop.submit(lambda e: time.sleep(self.rng.choice([0.001, 0.005])))
            with contextlib.suppress(Exception):
                await self.hook(w, "start", "racing")
            out = await task
        else:
            out = await w.start(req, subscriber)
        await self.hook(w, "start", "after")
        return out

    async def call(self, w, fn, *args):
        """A worker call, as Ray makes it: a dead worker fails it, the worker's errors
        are translated, and Ray-like it runs on should the caller stop waiting."""
        if self.is_down(w):
            raise WorkerLostError(w.worker_id, f"{w.worker_id} is gone")
        task = asyncio.ensure_future(fn(*args))
        if self.ray_like:
            self.calls.add(task)
        try:
            return await (asyncio.shield(task) if self.ray_like else task)
        except Exception as e:
            raise self.translate(w, e) from e

    async def hook(self, w, step: str, when: str) -> None:
        """At ``step:when``: the walk's event, once (``racing``: while the step runs)."""
        if self.delays:
            await asyncio.sleep(self.rng.choice([0, 0.001, 0.003]))
        if self.fired or self.stage != f"{step}:{when}":
            return
        self.fired = True
        await self.fire(step, when)

    async def fire(self, step: str, when: str) -> None:
        ev = self.event
        if ev == "fail":
            if when != "during":
                raise TransferError(f"injected: {step} {when}")
            if step.startswith("recv"):  # the receive fails: the pair is lost
                self.ch_src._lost.add("pair")
            return  # a send fails as it is let go (``fail_send``, armed before it)
        if ev == "hang":
            await asyncio.sleep(3 * TIMEOUT_S)
            return
        if ev == "finish":
            await self.finish_now()
            return
        if ev == "caller_leaves":
            self.consumer.cancel()
            return
        if ev == "pair_lost":
            self.ch_src._lost.add("pair")
            await asyncio.sleep(0.03)  # both receivers see it
            return
        w = self.src if ev.endswith("_src") else self.dst
        if ev.startswith("shutdown"):
            self.down.add(w)
            w.shutdown()
            if w in self.feeds:  # as Ray's streaming call of a dead actor: the feed fails
                await self.feeds[w].close()
        elif ev.startswith("abort"):
            await w.abort(self.rid)
        elif ev.startswith("gone") and w in self.feeds:  # the gateway's feed closed
            await self.feeds[w].close()

    async def finish_now(self) -> None:
        """The request ends on its own at its next step, wherever it runs."""
        def last_token(engine):
            seq = engine.scheduler.get(self.rid)
            if seq is not None:
                n = len(seq.output_token_ids) + 1
                seq.params = dataclasses.replace(seq.params, max_tokens=n)
        for w in (self.src, self.dst):
            with contextlib.suppress(EngineLoopStopped):
                await w._run(last_token)

    async def migrate(self, w, method: str, *args):
        step = {"migrate_begin": "begin", "migrate_in": "in", "migrate_pause": "pause",
                "migrate_expect": "expect", "migrate_done": "done"}.get(method)
        if method == "migrate_send":
            self.sends += 1
            step = f"send{self.sends}"
        if step is None:  # rollback: no stage of its own
            return await self.call(w, getattr(w, method), *args)
        await self.hook(w, step, "before")
        recv_step = f"recv{step[-1]}" if step.startswith("send") else None
        if self.stage in (f"{step}:during", f"{recv_step}:during") and not self.fired:
            return await self._during(w, method, step, recv_step, args)
        if self.stage == f"{step}:racing" and not self.fired:
            w.loop.submit(lambda e: time.sleep(self.rng.choice([0.001, 0.005])))  # a step
            task = _retrieved(asyncio.ensure_future(self.call(w, getattr(w, method), *args)))
            with contextlib.suppress(Exception):
                await self.hook(w, step, "racing")
            result = await task
        else:
            result = await self.call(w, getattr(w, method), *args)
        await self.hook(w, step, "after")
        return result

    async def _during(self, w, method, step, recv_step, args):
        """A KV round with its send (on the source) or its first payload receive (a write
        into the destination's blocks) held while the event happens."""
        sending = self.stage.startswith("send")
        ch = self.ch_src if sending else self.ch_dst
        if self.event == "fail" and sending:
            ch.fail_send = True
        held = ch.send_held if ch is self.ch_src else ch.recv_held
        self.hold.clear()
        if sending:
            ch.hold_send = self.hold
        else:
            ch.hold_recv = self.hold
        task = _retrieved(asyncio.ensure_future(self.call(w, getattr(w, method), *args)))
        try:
            for _ in range(300):
                if held.is_set() or task.done() and sending:
                    break
                await asyncio.sleep(0.002)
            self.fired = True
            await self.fire(step if sending else recv_step, "during")
            await asyncio.sleep(self.rng.choice([0, 0.002, 0.01]))
        finally:
            ch.hold_send = ch.hold_recv = None
            self.hold.set()
        result = await task
        await self.hook(w, step, "after")
        return result

    def ops(self, w) -> Ops:
        return Ops(self, w)

    def moved(self, done) -> None:
        """As the move resolves: moved, the source's copy is out of its batch; failed,
        the destination holds nothing of it (its abort was awaited)."""
        state = {w: getattr(w.requests.get(self.rid), "state", None) for w in (self.src, self.dst)}
        if done.result().outcome == MIGRATED:
            if state[self.src] is S.DECODING:
                self.violations.append("moved, and decoding on the source still")
        elif state[self.dst] is not None and not self.is_down(self.dst):
            self.violations.append(f"the move failed, the destination holds it {state[self.dst]}")

    # -- the client ---------------------------------------------------------------------
    async def run(self) -> None:
        moves: dict[str, Move] = {}
        src_ops = self.ops(self.src)
        follow = Follow(self.rid, self.prompt, self.params, src_ops,
                        DecodeRequest(self.rid, self.prompt, self.params), moves,
                        lambda *a: None)

        def ask():
            self.move = moves[self.rid] = Move(self.rid, self.ops(self.dst),
                                               transfer_id=f"{self.rid}#m")
            self.move.done.add_done_callback(self.moved)
        if self.ask_after == 0:
            ask()
        finished = False
        try:
            async with aclosing(follow.deltas()) as deltas:
                async for delta in deltas:
                    if delta.index != len(self.tokens):
                        self.violations.append(f"delta at {delta.index}, expected "
                                               f"{len(self.tokens)}")
                    self.tokens += delta.token_ids
                    finished = delta.finished
                    self.finish_reason = delta.finish_reason
                    if self.move is None and len(self.tokens) >= self.ask_after:
                        ask()
        except (WorkerLostError, TransferError) as e:  # the driver would re-drive it
            self.error = e
        finally:
            if not finished:  # as the driver's attempt does: free where it runs now
                current = follow.current.w
                if not self.is_down(current):
                    with contextlib.suppress(Exception):
                        await current.abort(self.rid)


class Ops:
    """``DecodeOps`` of one worker for the driver, every step through the walk."""

    def __init__(self, walk: Walk, w: DecodeWorker) -> None:
        self.walk, self.w = walk, w
        self.worker_id, self.rank = w.worker_id, w.rank

    async def migrate(self, method: str, *args):
        return await self.walk.migrate(self.w, method, *args)

    async def abort(self, request_id: str, transfer_id: str | None = None) -> None:
        await self.walk.call(self.w, self.w.abort, request_id, transfer_id)

    async def decode(self, req: DecodeRequest):
        """The request's deltas through the walk's feed of the worker, as ``RayDecode``."""
        walk, w, rid = self.walk, self.w, req.request_id
        if walk.is_down(w):
            raise WorkerLostError(w.worker_id, f"{w.worker_id} is gone")
        feed = walk.feed_of(w)
        queue_ = feed.register(rid)
        try:
            last = await walk.call(w, walk.start, w, req, feed.subscriber)
            if last is not None:
                yield last
                return
            while True:
                item = await queue_.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamError):
                    raise walk.translate(w, item.error)
                yield item
                if item.finished:
                    return
        finally:
            feed.unregister(rid)


class GatewayFeed:
    """The gateway's one feed of a worker (as ``cluster/feed_reader.py``): each request's
    items go to its queue; a request's stream closing only unregisters it. Closed (the
    gateway gone) or ended (the worker gone), every queue gets the failure and the worker
    drops the feed, which ends the requests still on it."""

    def __init__(self, w: DecodeWorker, name: str) -> None:
        self.w, self.subscriber = w, name
        self.queues: dict[str, asyncio.Queue] = {}
        self.failure: BaseException | None = None
        self.task = asyncio.ensure_future(self._read())

    def register(self, rid: str) -> asyncio.Queue:
        q = self.queues[rid] = asyncio.Queue()
        if self.failure is not None:
            q.put_nowait(self.failure)
        return q

    def unregister(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def _read(self) -> None:
        gen = self.w.feed(self.subscriber)
        try:
            async for batch in gen:
                for item in batch:
                    if (q := self.queues.get(item.request_id)) is not None:
                        q.put_nowait(item)
        finally:
            self.failure = WorkerLostError(self.w.worker_id, "the feed ended", transient=True)
            for q in self.queues.values():
                q.put_nowait(self.failure)
            await gen.aclose()

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task


def _retrieved(task: asyncio.Future) -> asyncio.Future:
    """``task``, its error retrieved should the walk stop waiting for it (the caller gone)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


async def _walk(walk: Walk) -> None:
    walk.instrument()
    try:
        walk.consumer = asyncio.ensure_future(walk.run())
        try:
            await asyncio.wait_for(asyncio.shield(walk.consumer), 20)
        except asyncio.CancelledError:
            pass
        with contextlib.suppress(asyncio.CancelledError):
            await walk.consumer
        walk.hold.set()
        await asyncio.gather(*walk.calls, return_exceptions=True)
        if walk.move is not None and walk.move.task is None and not walk.move.done.done():
            walk.move.finish(FAILED, "never taken up")  # as the driver's generate does
        for w in (walk.src, walk.dst):
            if not walk.is_down(w):
                await _until_free(w)
                walk.held_at_end[w.worker_id] = _holding(w)  # before the feeds close
        await asyncio.sleep(0.03)  # a stray write into the destination would land now
        for feed in walk.feeds.values():
            await feed.close()
    finally:
        walk.hold.set()
        walk.uninstrument()


def _holding(w: DecodeWorker) -> str | None:
    """What ``w`` still holds (None: nothing)."""
    if _all_free(w):
        return None
    return (f"{w.worker_id}: requests {[(r, q.state.name) for r, q in w.requests.items()]}, "
            f"transfers {list(w.receiver._pending) if w.receiver else None}, "
            f"{w.engine.block_pool.num_free} blocks free")


def _check(walk: Walk, refused: list) -> None:
    what = (f"walk {walk.n}: {walk.event} at {walk.stage} (move asked after "
            f"{walk.ask_after} tokens of {walk.max_tokens}, ray-like {walk.ray_like})")
    assert not walk.violations, f"{what}: {walk.violations}"
    assert walk.tokens == walk.reference[:len(walk.tokens)], f"{what}: tokens {walk.tokens}"
    ended_early = walk.event in ("abort_src", "abort_dst", "gone_src", "gone_dst",
                                 "caller_leaves", "shutdown_src", "shutdown_dst", "finish")
    if not (walk.fired and ended_early) and walk.error is None:
        assert walk.tokens == walk.reference, \
            f"{what}: {len(walk.tokens)} tokens, ended by {walk.finish_reason}"
    if walk.move is not None:
        assert walk.move.done.done(), f"{what}: the move never resolved"
        if walk.move.done.result().outcome == MIGRATED:
            assert "commit" in walk.log, f"{what}: moved, never committed: {walk.log}"
            assert "src_free" not in walk.log or \
                walk.log.index("commit") < walk.log.index("src_free"), \
                f"{what}: the source freed it before the destination committed"
    for w in (walk.src, walk.dst):
        if not walk.is_down(w):
            held = walk.held_at_end[w.worker_id] or _holding(w)
            assert held is None, f"{what}: still held after it ended: {held}"
    kv = walk.dst.engine.kv_cache.kv
    if not walk.is_down(walk.dst):
        for blocks, poisoned in walk.poisoned:
            assert torch.equal(kv[:, :, blocks], poisoned), \
                f"{what}: the destination's blocks {blocks} written after their free"
    unexpected = [r for r in refused if r not in EXPECTED_REFUSALS]
    assert not unexpected, f"{what}: lifecycle refusals {unexpected}"


@pytest.mark.parametrize("seed", range(3))
def test_a_move_under_random_events_loses_nothing_and_holds_nothing_after(pool, refusals,
                                                                           monkeypatch, seed):
    workers, refs, model_dir = pool
    monkeypatch.setattr(mig, "MIGRATE_TIMEOUT_S", TIMEOUT_S)
    rng = random.Random(seed)
    shutdowns = 0

    async def main(walk):
        await _walk(walk)

    for n in range(WALKS):
        stage, event = rng.choice(STAGES), rng.choice(EVENTS)
        if event.startswith("shutdown"):
            shutdowns += 1
            if shutdowns > SHUTDOWNS:
                event = "none"
        walk = Walk(rng, seed * 1000 + n, workers, refs, stage, event)
        refusals.clear()
        asyncio.run(main(walk))
        try:
            _check(walk, list(refusals))
        except AssertionError:
            # the walk's garbage finalized now, not while pytest parses sources for the
            # report (CPython < 3.11.8 then fails with "AST constructor recursion depth")
            gc.collect()
            raise
        for i, w in enumerate(workers):  # a worker shut down is replaced
            if walk.is_down(w):
                workers[i] = _new_worker(model_dir, f"{w.worker_id}+")


# -- one race at a time, in a set order ------------------------------------------------
PARAMS = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


async def _decoding(w: DecodeWorker, rid: str):
    """A request decoding on ``w``, its stream open (closing it ends the request)."""
    stream = decode_stream(w, DecodeRequest(rid, tuple(PROMPT), PARAMS))
    await anext(stream)
    return stream


def _stalled(w: DecodeWorker) -> threading.Event:
    """The engine of ``w`` held between two steps (its commands queue) until it is set."""
    gate = threading.Event()
    w.loop.submit(lambda e: gate.wait(10))
    return gate


def test_a_reservation_whose_source_is_lost_holds_nothing(pool):
    workers, _, _ = pool
    src, dst = workers
    channels = _wire(workers)

    async def main():
        channels[0]._lost.add("pair")
        while src.rank not in dst.receiver.dead_peers:
            await asyncio.sleep(0.005)
        with pytest.raises(MigrationError, match="unreachable"):
            await dst.migrate_in("lost", list(PROMPT), PARAMS, src.rank, "lost#m/1", 64, 2)
        assert _all_free(dst), dst.requests  # undone by itself, no abort from the driver
    asyncio.run(main())


def test_an_abort_while_the_last_round_is_reserved_leaves_no_round_expected(pool):
    workers, _, _ = pool
    src, dst = workers
    _wire(workers)

    async def main():
        desc = await dst.migrate_in("exp", list(PROMPT), PARAMS, src.rank, "exp#m/1", 40, 0)
        assert desc is not None and not desc.block_ids
        gate = _stalled(dst)  # the reservation grows behind this
        expecting = asyncio.ensure_future(dst.migrate_expect("exp", "exp#m/2", 0, 3, 40))
        await asyncio.sleep(0.01)
        aborting = asyncio.ensure_future(dst.abort("exp"))  # freed right after the growth
        await asyncio.sleep(0.01)
        gate.set()
        await aborting
        with pytest.raises(MigrationError, match="ended"):
            await expecting  # else its round writes into blocks freed already
        assert _all_free(dst), dst.receiver._pending
    asyncio.run(main())


async def _pre_copy_reserved(src, dst, rid: str):
    """``rid`` decoding on ``src``, its move begun and ``dst``'s blocks reserved for it:
    (its stream, the pre-copy round's descriptor)."""
    stream = await _decoding(src, rid)
    info = await src.migrate_begin(rid)
    desc = await dst.migrate_in(rid, list(PROMPT), PARAMS, src.rank, f"{rid}#m/1",
                                info["num_tokens"] + 64, info["num_full_blocks"])
    return stream, desc


def test_a_round_asked_for_as_the_request_ends_is_not_sent(pool):
    workers, _, _ = pool
    src, dst = workers
    channels = _wire(workers)

    async def main():
        stream, desc = await _pre_copy_reserved(src, dst, "snd")
        gate = _stalled(src)  # its blocks are looked up behind this
        sending = asyncio.ensure_future(src.migrate_send("snd", desc, 0))
        await asyncio.sleep(0.01)
        aborting = asyncio.ensure_future(src.abort("snd"))  # freed right after the lookup
        await asyncio.sleep(0.01)
        gate.set()
        await aborting
        with pytest.raises(MigrationError, match="stopped moving"):
            await sending  # else it reads blocks freed already
        assert channels[src.rank].sends == 0
        await dst.abort("snd")
        await stream.aclose()
        await _until_free(src)
        assert _all_free(src) and _all_free(dst)
    asyncio.run(main())


def test_a_round_still_reading_after_a_rollback_holds_the_blocks_until_it_is_off(pool):
    workers, _, _ = pool
    src, dst = workers
    channels = _wire(workers)

    async def main():
        stream, desc = await _pre_copy_reserved(src, dst, "rb")
        assert desc.block_ids
        hold = threading.Event()
        channels[src.rank].hold_send = hold
        sending = asyncio.ensure_future(src.migrate_send("rb", desc, 0))
        while not channels[src.rank].send_held.is_set():
            await asyncio.sleep(0.002)
        await dst.abort("rb")  # the driver gave the move up (a timeout): rolled back
        assert await src.migrate_rollback("rb")
        aborting = asyncio.ensure_future(src.abort("rb"))
        await asyncio.sleep(0.05)
        assert not aborting.done() and src.engine.scheduler.get("rb") is not None, \
            "the source freed its blocks while a round read them"
        hold.set()
        await aborting
        with contextlib.suppress(MigrationError):
            await sending
        await stream.aclose()
        await _until_free(src)
        assert _all_free(src) and _all_free(dst)
    asyncio.run(main())
