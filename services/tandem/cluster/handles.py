"""Ray actor handles seen through the router's protocols (``WorkerHandle``, ``PrefillOps``,
``DecodeOps``): a cached load snapshot, and Ray failures translated into the router's errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from tandem.common.sampling_params import SamplingParams
from tandem.cluster.feed_reader import FeedReader
from tandem.decode.feed import FeedClosedError, StreamError, within_stall
from tandem.decode.migration import MigrationError
from tandem.decode.worker import TransferFailedError
from tandem.engine.engine_loop import EngineLoopStopped
from tandem.prefill.worker import PrefillTimeoutError
from tandem.protocol.messages import KVTransferDescriptor
from tandem.protocol.request_path import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta
from tandem.router.driver import TransferError, WorkerLostError
from tandem.router.errors import PrefillQueueTimeoutError
from tandem.router.load import WorkerLoad
from tandem.transfer.channel import ChannelBrokenError

# Ray raises this for an actor it cannot reach right now (network blip, restarting node):
# retried, never taken for death. It subclasses RayActorError, so it is checked first.
_UNAVAILABLE = tuple(getattr(ray.exceptions, n) for n in ("ActorUnavailableError",)
                     if hasattr(ray.exceptions, n))
# ... and these for a dead actor.
_LOST = (RayActorError,) + tuple(getattr(ray.exceptions, n) for n in ("ActorDiedError",)
                                 if hasattr(ray.exceptions, n))
RETRY_AFTER_S = 1.0
CLEANUP_TIMEOUT_S = 60.0  # an abort waits for writes in flight (each bounded) and one engine step


def is_transient(e: BaseException) -> bool:
    """Whether a Ray error means "unreachable for now" rather than "dead"."""
    return isinstance(e, _UNAVAILABLE)


class RayWorker:
    """An actor plus the last load it reported."""

    def __init__(self, actor, worker_id: str, role: str, rank: int | None = None) -> None:
        self.actor, self.worker_id, self.role, self.rank = actor, worker_id, role, rank
        self._load = WorkerLoad(worker_id, role)
        self.last_error: BaseException | None = None  # of the last refresh
        self.last_raw: dict = {}  # the last load the worker reported

    def load(self) -> WorkerLoad:
        return self._load

    async def refresh(self, timeout_s: float = 5.0) -> None:
        """Fetch a new snapshot; a worker that does not answer is reported not alive
        (until a later refresh gets an answer)."""
        try:
            raw = await _within(_quiet(self.actor.load).remote(), timeout_s)
        except Exception as e:
            self.last_error = e
            self._load = WorkerLoad(self.worker_id, self.role, alive=False)
            return
        self.last_error = None
        self.last_raw = raw
        fields = {k: raw[k] for k in ("alive", "total_blocks", "free_blocks", "block_size",
                                      "running", "waiting", "queued_prefill_tokens",
                                      "max_num_seqs", "request_ids")}
        # 0.0 (not measured) from a worker that does not publish it
        fields["prefill_tokens_per_s"] = float(raw.get("prefill_tokens_per_s", 0.0))
        self._load = WorkerLoad(self.worker_id, self.role, **fields)

    def _translate(self, e: BaseException) -> BaseException:
        if isinstance(e, _UNAVAILABLE):
            return WorkerLostError(self.worker_id, f"{self.role} worker {self.worker_id} "
                                   f"unreachable: {e}", transient=True)
        if isinstance(e, _LOST):
            return WorkerLostError(self.worker_id, f"{self.role} worker {self.worker_id} lost: {e}")
        if isinstance(e, RayTaskError):
            return self._translate_cause(e.as_instanceof_cause())
        return e

    def _translate_cause(self, cause: BaseException) -> BaseException:
        """A worker's own exception as the router's: re-drive, retry later, or fail."""
        if isinstance(cause, (TransferFailedError, ChannelBrokenError, MigrationError)):
            return TransferError(str(cause))
        if isinstance(cause, EngineLoopStopped):
            return WorkerLostError(self.worker_id, f"{self.role} worker {self.worker_id}: "
                                   f"{cause}")
        if isinstance(cause, FeedClosedError):
            return WorkerLostError(self.worker_id, str(cause), transient=True)
        if isinstance(cause, PrefillTimeoutError):
            return PrefillQueueTimeoutError(str(cause), RETRY_AFTER_S)
        return cause


class RayPrefill(RayWorker):
    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        try:
            return await _quiet(self.actor.prefill).remote(req)
        except Exception as e:
            raise self._translate(e) from e

    async def abort(self, request_id: str) -> None:
        await _within(_quiet(self.actor.abort).remote(request_id), CLEANUP_TIMEOUT_S)


class RayDecode(RayWorker):
    """A decode worker; ``active`` names the requests this gateway has on it (from the
    reservation or the local prefill to the end of the stream or the abort), which a
    drain waits for; ``num_finished`` counts the streams that ended on it."""

    def __init__(self, actor, worker_id: str, role: str, rank: int | None = None) -> None:
        super().__init__(actor, worker_id, role, rank)
        self.active: set[str] = set()
        self.num_finished = 0
        self._readers: dict[asyncio.AbstractEventLoop, FeedReader] = {}  # one per event loop

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, src_rank: int, transfer_id: str,
                      layer_group_size: int | None, checksum: bool
                      ) -> KVTransferDescriptor | None:
        self.active.add(request_id)
        try:
            return await _quiet(self.actor.reserve).remote(
                request_id, list(prompt_token_ids), params, src_rank, transfer_id,
                layer_group_size, checksum)
        except Exception as e:
            raise self._translate(e) from e

    async def decode(self, req: DecodeRequest) -> AsyncIterator[TokenDelta]:
        """The request's deltas, read from this gateway's feed of the worker."""
        rid = req.request_id
        self.active.add(rid)
        feed = self._feed()
        queue = feed.register(rid)
        finished = False
        try:
            try:
                last = await _quiet(self.actor.start).remote(req, feed.subscriber)
            except Exception as e:
                raise self._translate(e) from e
            if last is not None:
                finished = True
                yield last
                return
            while not finished:
                item = await within_stall(queue.get(), rid, self.worker_id)
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamError):
                    raise self._translate_cause(item.error)
                finished = item.finished
                yield item
        finally:
            feed.unregister(rid)
            if finished:  # otherwise the driver aborts it
                self.num_finished += 1
                self.active.discard(rid)

    def _feed(self) -> FeedReader:
        """This gateway's open feed of the worker's actor on the running event loop (a new
        one after a failure or a replacement of the actor; those of closed loops are closed)."""
        loop = asyncio.get_running_loop()
        for other in [lp for lp in self._readers if lp.is_closed()]:
            self._readers.pop(other).close()
        reader = self._readers.get(loop)
        if reader is None or not reader.usable or reader.actor is not self.actor:  # or replaced
            if reader is not None:
                reader.close()
            reader = self._readers[loop] = FeedReader(self.actor, self.worker_id, self._translate)
        return reader

    async def migrate(self, method: str, *args):
        """One step of moving a request (``decode/migration.py``: ``migrate_begin``, ...),
        its failures translated; bounded like a cleanup call."""
        try:
            result = await _within(_quiet(getattr(self.actor, method)).remote(*args),
                                   CLEANUP_TIMEOUT_S)
        except Exception as e:
            raise self._translate(e) from e
        if method == "migrate_done":  # it runs elsewhere now: a drain does not wait for it
            self.active.discard(args[0])
        return result

    async def abort(self, request_id: str, transfer_id: str | None = None) -> None:
        args = (request_id,) if transfer_id is None else (request_id, transfer_id)
        try:
            await _within(_quiet(self.actor.abort).remote(*args), CLEANUP_TIMEOUT_S)
        finally:
            self.active.discard(request_id)


def _quiet(method, **options):
    """An actor method called without Ray task events: the GCS keeps a record of every
    task (up to 100,000), which for load polls and per-request calls is memory growing
    with uptime and traffic (the load polls alone keep it growing) and nothing reads."""
    return method.options(enable_task_events=False, **options)


async def _within(ref, timeout_s: float):
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
