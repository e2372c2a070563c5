"""Drives one request across the pools: reserve on D, prefill on P, stream from D.

Written against the async ``PrefillOps`` / ``DecodeOps`` protocols (the cluster
implements them over Ray actors; tests can use fakes). Token #1 comes from
P and is yielded at once; D continues from token 2. A dead worker or a failed
transfer re-drives the request: before token #1 from the start, after it on
another decode worker with prompt + tokens so far, and the caller's stream goes
on with no token lost or repeated (deltas carry their output index). A running
request moves to another decode worker with its KV on ``migrate`` (``migration.py``).
"""

from __future__ import annotations

import logging
import secrets
from contextlib import aclosing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from tandem.common.sampling_params import SamplingParams
from tandem.protocol.messages import KVTransferDescriptor
from tandem.protocol.request_path import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta
from tandem.router.errors import ClusterFullError
from tandem.router.migration import FAILED, Follow, Move, MoveResult, quietly
from tandem.router.router import Router

log = logging.getLogger(__name__)


class WorkerLostError(RuntimeError):
    """A worker died or stopped answering; ``worker_id`` names it.

    ``transient``: the worker is only unreachable for now (e.g. Ray's
    ``ActorUnavailableError``): the request is re-driven elsewhere but the
    worker is not marked dead.
    """

    def __init__(self, worker_id: str, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.transient = transient


class TransferError(RuntimeError):
    """A KV transfer failed while both workers live (timeout, checksum, refused)."""


class PrefillOps(Protocol):
    worker_id: str
    rank: int

    async def prefill(self, req: PrefillRequest) -> PrefillResult: ...
    async def abort(self, request_id: str) -> None: ...


class DecodeOps(Protocol):
    worker_id: str
    rank: int | None

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, src_rank: int, transfer_id: str,
                      layer_group_size: int | None, checksum: bool
                      ) -> KVTransferDescriptor | None: ...
    def decode(self, req: DecodeRequest) -> AsyncIterator[TokenDelta]: ...
    async def abort(self, request_id: str, transfer_id: str | None = None) -> None:
        """End the request here; ``transfer_id`` names the attempt's reservation, which
        is refused should its ``reserve`` run after this abort."""
    async def migrate(self, method: str, *args):
        """One step of moving a request between decode workers (``decode/migration.py``)."""


class RequestDriver:
    """Runs requests through ``router`` with bounded retries."""

    def __init__(self, router: Router, *, max_attempts: int = 3,
                 layer_group_size: int | None = None, checksum: bool = False,
                 wait_until_serving: Callable[[], Awaitable[None]] | None = None,
                 on_moved: Callable[[MoveResult], None] | None = None) -> None:
        """``wait_until_serving()`` returns once the cluster can serve again (bounded;
        e.g. a transfer group rebuild finished): a re-drive awaits it first instead of
        spending its attempts against a group that is being rebuilt. ``on_moved(result)``
        hears how each move ended."""
        self.router = router
        self.max_attempts = max_attempts
        self.layer_group_size = layer_group_size
        self.checksum = checksum
        self.wait_until_serving = wait_until_serving
        self.num_redrives = 0
        self._on_move_ended = on_moved
        self._moves: dict[str, Move] = {}  # moves asked for, until each ends
        self._follows: dict[str, Follow] = {}  # the requests streaming from a decode worker

    def migrate(self, request_id: str, dst: DecodeOps) -> Move:
        """Ask that a running request move to ``dst`` with its KV; its stream runs the move
        at its next token. ``Move.done`` (a thread-safe future) gets the ``MoveResult``.
        Call on the event loop the requests run on."""
        if self.router.decode_of(request_id) is None:
            raise KeyError(f"request {request_id!r} is not in flight")
        if request_id in self._moves:
            raise ValueError(f"request {request_id!r} is moving already")
        move = self._moves[request_id] = Move(request_id, dst,
                                               transfer_id=transfer_id(request_id, 0) + ".m")
        move.done.add_done_callback(lambda f: self._on_move_ended and self._on_move_ended(f.result()))
        return move

    def running(self) -> list[Follow]:
        """The requests streaming from a decode worker now (any thread may call it)."""
        return list(self._follows.values())

    def _moved(self, result: MoveResult, src: DecodeOps, dst: DecodeOps) -> None:
        """A request's stream comes from ``dst`` now (it moved off ``src``)."""
        self.router.moved(result.request_id, dst)

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas in order; raises ``ClusterFullError`` when full."""
        prompt = tuple(prompt_token_ids)
        max_tokens = params.max_tokens or 1 << 30
        decision = self.router.route(request_id, prompt, max_tokens)
        produced: list[int] = []
        attempt = 0
        try:
            while True:
                try:
                    async with aclosing(self._attempt(request_id, prompt, params, decision,
                                                      produced, attempt)) as deltas:
                        async for delta in deltas:
                            produced.extend(delta.token_ids)
                            yield delta
                    return
                except (WorkerLostError, TransferError) as e:
                    attempt += 1
                    if attempt >= self.max_attempts:
                        raise
                    lost = {e.worker_id} if isinstance(e, WorkerLostError) else set()
                    if isinstance(e, WorkerLostError) and not e.transient:
                        self.router.mark_dead(e.worker_id)
                    log.warning("re-driving %s after %s (attempt %d)", request_id, e, attempt)
                    self.num_redrives += 1
                    if self.wait_until_serving is not None:
                        await self.wait_until_serving()
                    decision = self.router.retry(
                        request_id, exclude=lost, prompt_token_ids=prompt + tuple(produced),
                        max_tokens=max(1, max_tokens - len(produced)), resume=bool(produced))
        finally:
            move = self._moves.pop(request_id, None)  # asked for, never taken up
            if move is not None:
                move.finish(FAILED, "the request ended before it moved")
            self.router.complete(request_id)

    async def _attempt(self, rid: str, prompt: tuple[int, ...], params: SamplingParams,
                       decision, produced: list[int], attempt: int) -> AsyncIterator[TokenDelta]:
        decode: DecodeOps = decision.decode
        prefill: PrefillOps | None = decision.prefill
        finished = False
        tid = None
        follow: Follow | None = None
        try:
            if prefill is None or produced:  # local prefill, or re-drive after token #1
                req = DecodeRequest(rid, prompt, params, output_token_ids=tuple(produced))
            else:
                tid = transfer_id(rid, attempt)
                desc = await decode.reserve(rid, prompt, params, prefill.rank, tid,
                                            self.layer_group_size, self.checksum)
                if desc is None:
                    raise ClusterFullError(f"decode worker {decode.worker_id} has no free blocks",
                                           retry_after_s=self.router.config.retry_after_s)
                try:
                    result = await prefill.prefill(PrefillRequest(rid, prompt, params, desc))
                except BaseException:
                    await quietly(prefill.abort(rid))
                    raise
                self.router.prefill_done(rid)
                lp = (result.first_logprob,) if result.first_logprob is not None else None
                if result.finish_reason is not None:  # token #1 ends it: D's reservation is freed below
                    yield TokenDelta(rid, (result.first_token_id,), 0, True, result.finish_reason, lp)
                    return
                yield TokenDelta(rid, (result.first_token_id,), 0, logprobs=lp)
                req = DecodeRequest(rid, prompt, params,
                                    output_token_ids=(result.first_token_id,), descriptor=desc)
            follow = Follow(rid, prompt, params, decode, req, self._moves, self._moved,
                            self.checksum)
            self._follows[rid] = follow
            async with aclosing(follow.deltas()) as stream:
                async for delta in stream:
                    finished = delta.finished
                    yield delta
        finally:
            if follow is not None and self._follows.get(rid) is follow:
                del self._follows[rid]
            if not finished:  # the caller left or a worker failed: free D's blocks and slot
                if follow is not None and follow.current is not decode:
                    decode, tid = follow.current, None  # it moved: the worker it runs on now
                await quietly(decode.abort(rid, tid))


def transfer_id(request_id: str, attempt: int) -> str:
    """A transfer id unique to one attempt of one request, across gateway restarts too:
    KV that arrives for an older attempt (or another request) matches no expected id."""
    return f"{request_id}#{attempt}.{secrets.token_hex(4)}"
