"""Moving a running request to another decode worker with its KV: the driver's side.

A :class:`Move` asks that one request move (``RequestDriver.migrate``); the request's
:class:`Follow` (its stream of deltas from its decode worker) picks it up at its next
token and runs it, pre-copy:

1. while the source decodes on: ``migrate_begin`` on the source (its full blocks),
   ``migrate_in`` on the destination (blocks for its tokens plus ``HEADROOM_TOKENS``),
   ``migrate_send`` of the full blocks;
2. the switch: ``migrate_pause`` on the source; ``migrate_expect`` on the destination and
   ``migrate_send`` of the blocks written since, while the source's last tokens are read;
   then the destination's stream starts (``DecodeRequest(migrated=True)``) and, with its
   first token, the source releases the request (``migrate_done``).

Until that first token the source owns the request: any failure or a timeout rolls back
(the destination's blocks freed, the source decoding on where it paused:
``migrate_rollback``); an end there meanwhile (an abort, its feed gone) stops the move
and the stream ends as the source says; a source that died takes the re-drive path. The
worker calls are in ``decode/migration.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.common.sampling_params import SamplingParams
from tandem.protocol.request_path import DecodeRequest, TokenDelta

if TYPE_CHECKING:
    from tandem.router.driver import DecodeOps

log = logging.getLogger(__name__)
HEADROOM_TOKENS = 64  # reserved past the tokens at the start: the source decodes on meanwhile
MIGRATE_TIMEOUT_S = 30.0  # each of the two phases; then it is rolled back
MIGRATED, FAILED = "migrated", "failed"


@dataclass(frozen=True)
class MoveResult:
    """How a move ended: ``migrated`` (``pause_s``: the longest gap the client saw across
    it) or ``failed`` (``error``: why; the request went on where it was, or ended)."""

    request_id: str
    outcome: str
    error: str | None = None
    pause_s: float | None = None
    kv_bytes: int = 0


@dataclass(eq=False)
class Move:
    """A request asked to move to ``dst``; ``done`` (thread-safe) gets its result."""

    request_id: str
    dst: DecodeOps
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    transfer_id: str = ""
    task: asyncio.Task | None = None  # the pre-copy
    reserved: bool = False  # the destination may hold blocks for it
    kv_bytes: int = 0

    @property
    def first_round(self) -> str:
        """The transfer id of the pre-copy, which also names the destination's reservation."""
        return f"{self.transfer_id}/1"

    def finish(self, outcome: str, error: str | None = None, pause_s: float | None = None
               ) -> MoveResult:
        result = MoveResult(self.request_id, outcome, error, pause_s, self.kv_bytes)
        if not self.done.done():
            self.done.set_result(result)
        return result


class Follow:
    """The deltas of one request from its decode worker (``current``), across moves."""

    def __init__(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams,
                 decode: DecodeOps, req: DecodeRequest, moves: dict[str, Move],
                 on_moved: Callable[[MoveResult, DecodeOps, DecodeOps], None],
                 checksum: bool = False) -> None:
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.current = decode
        self._req = req
        self._moves = moves
        self._on_moved = on_moved
        self._checksum = checksum
        self.received = len(req.output_token_ids)  # the next output index the caller needs

    @property
    def num_tokens(self) -> int:
        """Its tokens so far (prompt and output): the KV it holds."""
        return len(self.prompt) + self.received

    @property
    def remaining(self) -> int:
        """Tokens still to come, at most."""
        return (self.params.max_tokens or 1 << 30) - self.received

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        """The deltas after ``received``, in order; ends with the finishing one."""
        rid = self.request_id
        stream = aiter(self.current.decode(self._req))
        nxt: asyncio.Future | None = None  # a read of ``stream`` raced against a move
        move: Move | None = None
        moved_off: DecodeOps | None = None  # the worker it just moved off, until released there
        unused = None  # a destination's stream not taken yet
        last_at = time.monotonic()
        try:
            while True:
                if move is None and self.received > len(self._req.output_token_ids):
                    move = self._moves.get(rid)  # taken up once it decodes there
                    if move is not None and move.dst.worker_id == self.current.worker_id:
                        self._end(move, FAILED, f"{rid} runs on {move.dst.worker_id} already")
                        move = None
                if move is not None:
                    if move.task is None:
                        move.task = asyncio.ensure_future(self._precopy(move))
                    if nxt is None:
                        nxt = asyncio.ensure_future(anext(stream))
                    await asyncio.wait((nxt, move.task), return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():  # pre-copied (or failed): switch (or roll back)
                        read, new, nxt, outcome = await self._switch(move, stream, nxt)
                        pause_s = time.monotonic() - last_at  # the read ones were held back too
                        unused = new  # closed should the caller leave before it is taken
                        if new is None:
                            self._end(move, FAILED, outcome)
                            move = None
                        for delta in read:
                            yield delta
                            last_at = time.monotonic()
                            if delta.finished:  # it ended on the source
                                return
                        if new is None:
                            continue
                        delta, src = outcome, self.current
                        await _stop(nxt)  # the source's stream is done with
                        with contextlib.suppress(BaseException):
                            await stream.aclose()
                        stream, nxt, self.current, unused = new, None, move.dst, None
                        result = self._end(move, MIGRATED, pause_s=pause_s)
                        move, moved_off = None, src  # released there once its first token is out
                        self._on_moved(result, src, self.current)
                    else:
                        delta, nxt = nxt.result(), None
                elif nxt is not None:  # a read left pending by a move rolled back
                    delta, nxt = await nxt, None
                else:
                    delta = await anext(stream)
                delta = delta.after(self.received)
                if delta is None:
                    continue
                self.received = delta.next_index
                yield delta
                last_at = time.monotonic()
                if moved_off is not None:  # acknowledged: the source frees it, before any new move
                    await self._release_source(moved_off)
                    moved_off = None
                if delta.finished:
                    return
        except StopAsyncIteration:
            return
        finally:
            if moved_off is not None:
                await self._release_source(moved_off)
            if unused is not None:
                with contextlib.suppress(Exception):
                    await unused.aclose()
            if move is not None:  # the request ended or its caller left mid-move
                if move.task is not None:  # stopped before the destination's abort
                    move.task.cancel()
                    await asyncio.wait((move.task,))
                    if not move.task.cancelled():
                        move.task.exception()  # retrieved: it ended with the request
                if move.reserved:
                    await quietly(move.dst.abort(rid, move.first_round))
                self._end(move, FAILED, "the request ended before it moved")
            if nxt is not None:
                await _stop(nxt)
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _release_source(self, src: DecodeOps) -> None:
        """The request streams from the destination: the source frees its copy
        (``migrate_done``), or, should that call fail, an abort does (its stream is read by
        no one now), so that a lost call leaks no blocks there."""
        try:
            await src.migrate("migrate_done", self.request_id)
        except Exception as e:  # noqa: BLE001 - gone, or it ended there meanwhile
            log.info("migrate_done of %s on %s failed (%s): aborting it there",
                     self.request_id, src.worker_id, e)
            await quietly(src.abort(self.request_id))

    def _end(self, move: Move, outcome: str, error: str | None = None,
             pause_s: float | None = None) -> MoveResult:
        """The move is over: another may be asked for from now on."""
        if self._moves.get(self.request_id) is move:
            del self._moves[self.request_id]
        return move.finish(outcome, error, pause_s)

    async def _precopy(self, move: Move) -> int:
        """Phase 1 (bounded: one task, so that its failure is never lost in a cancel);
        returns how many blocks went (the full blocks at its start)."""
        src, rid = self.current, self.request_id
        async with asyncio.timeout(MIGRATE_TIMEOUT_S):
            info = await src.migrate("migrate_begin", rid)
            move.reserved = True  # from the call on: aborted by its round's id, should it come late
            desc = await move.dst.migrate(
                "migrate_in", rid, list(self.prompt), self.params, src.rank, move.first_round,
                info["num_tokens"] + HEADROOM_TOKENS, info["num_full_blocks"], self._checksum)
            if desc is None:
                move.reserved = False
                raise RuntimeError(f"{move.dst.worker_id} has no room for {rid}")
            if desc.block_ids:
                move.kv_bytes += await src.migrate("migrate_send", rid, desc, 0)
            return info["num_full_blocks"]

    async def _switch(self, move: Move, stream, nxt: asyncio.Future
                      ) -> tuple[list[TokenDelta], Any, asyncio.Future, Any]:
        """Phase 2: ``(source deltas read meanwhile, the destination's stream, the source
        read still pending, its first delta)``; rolled back: ``(..., None, ..., why)``."""
        src, dst, rid = self.current, move.dst, self.request_id
        read: list[TokenDelta] = []
        new = None
        final = None
        try:
            async with asyncio.timeout(MIGRATE_TIMEOUT_S):
                num_sent = move.task.result()
                state = await src.migrate("migrate_pause", rid)
                outputs = tuple(state["output_token_ids"])
                final = asyncio.ensure_future(self._final_round(move, state, num_sent))
                while self.received < len(outputs):  # the source's last tokens
                    delta = (await asyncio.shield(nxt)).after(self.received)
                    nxt = asyncio.ensure_future(anext(stream))
                    if delta is not None:
                        self.received = delta.next_index
                        read.append(delta)
                        if delta.finished:
                            raise MoveStopped(f"{rid} ended on {src.worker_id}")
                desc = await _unless_ended(final, nxt, src)
                new = aiter(dst.decode(DecodeRequest(rid, self.prompt, self.params, outputs,
                                                     descriptor=desc, migrated=True)))
                first = await _unless_ended(anext(new), nxt, src)  # committed there, stepping
                return read, new, nxt, first
        except BaseException as e:
            if final is not None:
                final.cancel()
            if new is not None:
                with contextlib.suppress(Exception):
                    await new.aclose()
            if move.reserved:
                await quietly(dst.abort(rid, move.first_round))
            try:
                if isinstance(e, (asyncio.CancelledError, GeneratorExit)) \
                        or getattr(e, "worker_id", None) == src.worker_id:  # left, or re-drive
                    raise
                log.info("moving %s from %s to %s failed: %s", rid, src.worker_id,
                         dst.worker_id, e)
                await src.migrate("migrate_rollback", rid)  # False: it ended there, see its stream
            except BaseException:
                await _stop(nxt)  # the source's read begun here: its stream can be closed
                raise
            return read, None, nxt, f"{type(e).__name__}: {e}"

    async def _final_round(self, move: Move, state: dict, num_sent: int):
        """The last round: blocks ``num_sent`` onwards; returns its descriptor (None: none)."""
        src, rid = self.current, self.request_id
        num_blocks = state["num_blocks"] - num_sent
        desc = await move.dst.migrate(
            "migrate_expect", rid, f"{move.transfer_id}/2", num_sent, num_blocks,
            state["num_computed_tokens"] + 1, self._checksum)
        if not desc.block_ids:
            return None
        move.kv_bytes += await src.migrate("migrate_send", rid, desc, num_sent)
        return desc


async def _stop(fut: asyncio.Future) -> None:
    """A read no one takes: cancelled and awaited (its stream can be closed then), or its
    outcome retrieved (the stream may have failed once it was done with)."""
    if not fut.done():
        fut.cancel()
    with contextlib.suppress(BaseException):
        await fut


class MoveStopped(RuntimeError):
    """The request ended on the source before the destination's first token."""


async def _unless_ended(aw, nxt: asyncio.Future, src: DecodeOps):
    """``await aw``, unless the source's stream (its read ``nxt``, pending while it is
    paused) ends first: an abort there or its feed gone. Until the destination's first
    token the source owns the request, so then the move stops (``MoveStopped``, or the
    stream's own error) and the stream ends as the source says."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait((task, nxt), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled() or not task.done() or (nxt.done() and task.exception() is not None):
        nxt.result()  # the source's error (its death: re-drive)
        raise MoveStopped(f"the request ended on {src.worker_id} during its move")
    return task.result()


async def quietly(aw) -> None:
    """Await a cleanup call, its failure logged and dropped (the worker may be gone)."""
    try:
        await aw
    except Exception as e:  # best effort: the worker may be gone already
        log.debug("cleanup call failed: %s", e)

