"""Ray actor handles seen through the router's protocols (``WorkerHandle``, ``PrefillOps``,
``DecodeOps``): a cached load snapshot, and Ray failures translated into the router's errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from services.common.sampling_params import SamplingParams
from services.decode.worker import TransferFailedError
from services.protocol.messages import KVTransferDescriptor
from services.protocol.request_path import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta
from services.router.driver import TransferError, WorkerLostError
from services.router.worker import WorkerLoad

# Ray raises these for a dead, restarting or unreachable actor.
_LOST = (RayActorError,) + tuple(
    getattr(ray.exceptions, n) for n in ("ActorDiedError", "ActorUnavailableError")
    if hasattr(ray.exceptions, n))


class RayWorker:
    """An actor plus the last load it reported."""

    def __init__(self, actor, worker_id: str, role: str, rank: int | None = None) -> None:
        self.actor, self.worker_id, self.role, self.rank = actor, worker_id, role, rank
        self._load = WorkerLoad(worker_id, role)

    def load(self) -> WorkerLoad:
        return self._load

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Fetch a new snapshot; a worker that does not answer is reported dead."""
        try:
            raw = await _within(self.actor.load.remote(), timeout_s)
        except Exception:
            self._load = WorkerLoad(self.worker_id, self.role, alive=False)
            return
        fields = {k: raw[k] for k in ("alive", "total_blocks", "free_blocks", "block_size",
                                      "running", "waiting", "queued_prefill_tokens",
                                      "max_num_seqs", "request_ids")}
        self._load = WorkerLoad(self.worker_id, self.role, **fields)

    def _translate(self, e: BaseException) -> BaseException:
        if isinstance(e, _LOST):
            return WorkerLostError(self.worker_id, f"{self.role} worker {self.worker_id} lost: {e}")
        if isinstance(e, RayTaskError):
            cause = e.as_instanceof_cause()
            if isinstance(cause, TransferFailedError):
                return TransferError(str(cause))
            return cause
        return e


class RayPrefill(RayWorker):
    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        try:
            return await self.actor.prefill.remote(req)
        except Exception as e:
            raise self._translate(e) from e

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)


class RayDecode(RayWorker):
    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, src_rank: int, transfer_id: str,
                      layer_group_size: int | None, checksum: bool
                      ) -> KVTransferDescriptor | None:
        try:
            return await self.actor.reserve.remote(request_id, list(prompt_token_ids), params,
                                                   src_rank, transfer_id, layer_group_size,
                                                   checksum)
        except Exception as e:
            raise self._translate(e) from e

    async def decode(self, req: DecodeRequest) -> AsyncIterator[TokenDelta]:
        gen = self.actor.decode.options(num_returns="streaming").remote(req)
        try:
            async for ref in gen:
                yield await ref
        except Exception as e:
            raise self._translate(e) from e
        finally:
            ray.cancel(gen)  # no-op once it has finished

    async def cancel(self, request_id: str) -> None:
        await self.actor.cancel.remote(request_id)

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)


async def _within(ref, timeout_s: float):
    import asyncio

    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
