"""Drives one request across the pools: reserve on D, prefill on P, stream from D.

Written against the async ``PrefillOps`` / ``DecodeOps`` protocols (the cluster
implements them over Ray actors; tests can use fakes). Token #1 comes from
P and is yielded at once; D continues from token 2. A dead worker or a failed
transfer re-drives the request: before token #1 from the start, after it on
another decode worker with prompt + tokens so far, and the caller's stream goes
on with no token lost or repeated (deltas carry their output index).
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

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, src_rank: int, transfer_id: str,
                      layer_group_size: int | None, checksum: bool
                      ) -> KVTransferDescriptor | None: ...
    def decode(self, req: DecodeRequest) -> AsyncIterator[TokenDelta]: ...
    async def abort(self, request_id: str, transfer_id: str | None = None) -> None:
        """End the request here; ``transfer_id`` names the attempt's reservation, which
        is refused should its ``reserve`` run after this abort."""


class RequestDriver:
    """Runs requests through ``router`` with bounded retries."""

    def __init__(self, router: Router, *, max_attempts: int = 3,
                 layer_group_size: int | None = None, checksum: bool = False,
                 wait_until_serving: Callable[[], Awaitable[None]] | None = None) -> None:
        """``wait_until_serving()`` returns once the cluster can serve again (bounded;
        e.g. a transfer group rebuild finished): a re-drive awaits it first instead of
        spending its attempts against a group that is being rebuilt."""
        self.router = router
        self.max_attempts = max_attempts
        self.layer_group_size = layer_group_size
        self.checksum = checksum
        self.wait_until_serving = wait_until_serving
        self.num_redrives = 0

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
            self.router.complete(request_id)

    async def _attempt(self, rid: str, prompt: tuple[int, ...], params: SamplingParams,
                       decision, produced: list[int], attempt: int) -> AsyncIterator[TokenDelta]:
        decode: DecodeOps = decision.decode
        prefill: PrefillOps | None = decision.prefill
        finished = False
        tid = None
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
                    await _quietly(prefill.abort(rid))
                    raise
                self.router.prefill_done(rid)
                lp = (result.first_logprob,) if result.first_logprob is not None else None
                if result.finish_reason is not None:  # token #1 ends it: D's reservation is freed below
                    yield TokenDelta(rid, (result.first_token_id,), 0, True, result.finish_reason, lp)
                    return
                yield TokenDelta(rid, (result.first_token_id,), 0, logprobs=lp)
                req = DecodeRequest(rid, prompt, params,
                                    output_token_ids=(result.first_token_id,), descriptor=desc)
            received = len(req.output_token_ids)
            async with aclosing(decode.decode(req)) as stream:
                async for delta in stream:
                    delta = delta.after(received)
                    if delta is None:
                        continue
                    received, finished = delta.next_index, delta.finished
                    yield delta
        finally:
            if not finished:  # the caller left or a worker failed: free D's blocks and slot
                await _quietly(decode.abort(rid, tid))


def transfer_id(request_id: str, attempt: int) -> str:
    """A transfer id unique to one attempt of one request, across gateway restarts too:
    KV that arrives for an older attempt (or another request) matches no expected id."""
    return f"{request_id}#{attempt}.{secrets.token_hex(4)}"


async def _quietly(aw) -> None:
    try:
        await aw
    except Exception as e:  # best effort: the worker may be gone already
        log.debug("cleanup call failed: %s", e)
