"""The decode worker: an engine in the decode role plus the receiving end of KV transfer.

It reserves a prompt's blocks before the prefill starts, receives the KV into
them, joins the request to its continuous batch once the transfer is done and
token #1 is known, and streams the following tokens. It can also prefill
locally (conditional disaggregation, re-drive after a failure).

On CUDA the transfer is DONE once its writes completed on the device, and the
request joins the batch only after the compute stream waited (device-side) for
the transfer's last write event: the first step that reads the blocks comes
after the bytes, with no host sync on the compute thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence

from tandem.common.config import EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import EngineOutput
from tandem.protocol.messages import (KVTransferDescriptor,
                                        TransferStatus, layer_groups)
from tandem.decode.feed import FeedItem, Feeds, delta_of
from tandem.protocol.request_path import DecodeRequest, TokenDelta
from tandem.transfer.endpoint import make_receiver, open_channel
from tandem.transfer.receiver import KVReceiver
from tandem.worker.engine_worker import EngineWorker
from tandem.worker.decode_board import SLOTS, DecodeBoard
from tandem.worker.threads import ElasticThreads

log = logging.getLogger(__name__)
ABORTED_TRANSFERS_KEPT = 4096  # transfer ids remembered from aborts, newest kept


class TransferFailedError(RuntimeError):
    """The KV of a request did not arrive (dead prefill worker, timeout, checksum)."""


class _Waiter:
    """A call waiting for an earlier release of its request id; ``ended`` by a later abort."""

    ended = False


class DecodeWorker(EngineWorker):
    """Wrap with ``ray.remote`` (async actor); one engine, one receiver.

    One owner, one order for a remote-prefill request's blocks: ``reserve``
    takes them (RESERVED in the scheduler) and registers the transfer; the
    transfer ends DONE (the request joins the batch) or is aborted, after which
    no write into the blocks is in flight and later groups are drained; only
    then are the blocks freed. Every way a request ends (``abort``,
    its feed closed at any point, a failed or timed-out transfer, cancellation
    during ``reserve``) goes through :meth:`_end`, one task per request that
    later callers await.
    """

    def __init__(self, worker_id: str, config: EngineConfig, transfer_timeout_s: float = 30.0,
                 role: str = "decode", sync=None, burst_threads: int = 0,
                 board: str | None = None) -> None:
        """``burst_threads``: torch threads while no remote prefill is pending for this
        worker (``ElasticThreads``; 0: always ``config.num_threads``); ``board``: the
        host's ``DecodeBoard``, where this worker publishes how many requests it holds."""
        super().__init__(worker_id, config, role, sync=sync)
        self.threads = ElasticThreads(self.num_threads, burst_threads)
        self.board, self._slot = self._open_board(board, worker_id)
        self.receiver: KVReceiver | None = None
        self.rank: int | None = None
        self.transfer_timeout_s = transfer_timeout_s
        self._transfers: dict[str, tuple[str, KVReceiver]] = {}  # request -> (transfer, receiver)
        self._reserving: dict[str, asyncio.Task] = {}  # request -> its reserve in progress
        self._ending: dict[str, asyncio.Task] = {}  # request -> its release in progress
        self._settling: dict[str, list[_Waiter]] = {}  # request -> calls waiting for that release
        # transfer ids of attempts aborted here; a reserve that arrives after its own abort
        # (an async actor runs calls in no set order) is refused instead of holding blocks
        self._aborted_transfers: OrderedDict[str, None] = OrderedDict()
        self.feeds = Feeds(worker_id, self.loop.close_stream)
        self.kv_bytes_received = 0
        self._retune_threads()
        if self.board is not None:
            self.loop.between_steps = self._publish_held

    @staticmethod
    def _open_board(path: str | None, worker_id: str) -> tuple[DecodeBoard | None, int]:
        slot = DecodeBoard.slot_of(worker_id)
        if path is None:
            return None, 0
        if slot is None:  # unseen by the prefill workers, which then never take its cores
            raise ValueError(f"{worker_id} has no slot on the decode board (at most {SLOTS} "
                             "decode workers a host)")
        return DecodeBoard(path), slot

    def _publish_held(self, engine) -> None:
        """On the engine thread: the requests this worker holds, for the host's prefill workers."""
        self.board.publish(self._slot, len(engine.scheduler.seqs))

    def _retune_threads(self) -> None:
        """Queue the thread count for the pending transfers now (applied between steps)."""
        if self.threads.enabled:
            pending = len(self._transfers)  # now: the commands apply in the order they were queued
            self.loop.submit(lambda e: self.threads.apply(pending))

    def join_transfer_group(self, transports: Mapping[int, str], world_size: int, rank: int,
                            group_name: str, prefill_ranks: Sequence[int],
                            timeout_ms: int = 30_000, op_timeout_s: float = 30.0) -> int:
        """Become ``rank`` of the transfer group, receiving from ``prefill_ranks`` over the
        transports named in ``transports``; returns once every pair is connected."""
        channel = open_channel(transports, world_size, rank, group_name, self.sync,
                               senders=prefill_ranks, timeout_ms=timeout_ms,
                               op_timeout_s=op_timeout_s)
        self.receiver = make_receiver(channel, self.engine, prefill_ranks)
        self.rank = rank
        return rank

    def leave_transfer_group(self) -> None:
        """Leave the group; transfers still in flight fail (and their requests are re-driven)."""
        if self.receiver is not None:
            receiver, self.receiver = self.receiver, None
            receiver.channel.close()

    def transfer_broken(self) -> str | None:
        receiver = self.receiver
        if receiver is None:
            return "left the transfer group" if self.rank is not None else None
        return receiver.broken

    def counters(self) -> dict:
        return {"kv_bytes_received": self.kv_bytes_received,
                "pending_transfers": len(self._transfers),
                "thread_switches": self.threads.switches}

    # -- remote prefill: reserve, receive, decode -------------------------------
    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, src_rank: int, transfer_id: str,
                      layer_group_size: int | None = None, checksum: bool = False
                      ) -> KVTransferDescriptor | None:
        """Take blocks for the prompt and expect its KV from ``src_rank``; None when full.

        Cancelled midway, the reservation is released once it has been made. Refused
        when the attempt's abort (same ``transfer_id``) came first.
        """
        if transfer_id in self._aborted_transfers:
            del self._aborted_transfers[transfer_id]
            raise TransferFailedError(f"{request_id}: aborted on {self.worker_id} before its "
                                      f"reservation")
        if not await self._settled(request_id):
            raise TransferFailedError(f"{request_id}: ended on {self.worker_id} before its reservation")
        task = asyncio.ensure_future(self._reserve(request_id, prompt_token_ids, params,
                                                   src_rank, transfer_id, layer_group_size,
                                                   checksum))
        self._reserving[request_id] = task
        task.add_done_callback(lambda t: self._forget_task(self._reserving, request_id, t))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.shield(self._end(request_id))
            raise

    async def _reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams, src_rank: int, transfer_id: str,
                       layer_group_size: int | None, checksum: bool
                       ) -> KVTransferDescriptor | None:
        receiver = self.receiver
        if receiver is None or receiver.broken is not None:
            raise TransferFailedError(f"decode worker {self.worker_id} has no working transfer "
                                      f"group ({receiver.broken if receiver else 'not joined'})")
        blocks, reserved = await self._run(lambda e: self._reserve_blocks(
            e, request_id, prompt_token_ids, params))
        if blocks is None:
            return None
        groups = layer_groups(self.engine.model_config.num_layers, layer_group_size)
        try:
            receiver.expect(transfer_id, src_rank, blocks, [g.layers for g in groups],
                            after=reserved)
        except Exception as e:
            await self._run(lambda e: e.cancel_reserved(request_id))  # nothing can write yet
            raise TransferFailedError(f"{request_id}: {e}") from e
        self._transfers[request_id] = (transfer_id, receiver)
        self._retune_threads()
        return KVTransferDescriptor(
            request_id=request_id, transfer_id=transfer_id, block_ids=tuple(blocks),
            layer_groups=groups, src_rank=src_rank, dst_rank=self.rank,
            num_prompt_tokens=len(prompt_token_ids), checksum=checksum)

    def _reserve_blocks(self, engine, request_id: str, prompt_token_ids: Sequence[int],
                        params: SamplingParams):
        """On the engine thread: the blocks, and an event on the compute stream after the
        work queued so far (kernels of the blocks' earlier owner), which the KV's first
        write waits for."""
        blocks = engine.reserve(request_id, prompt_token_ids, params)
        if blocks is None:
            return None, None
        if self.board is not None:  # before the prefill can start: it must count this one
            self._publish_held(engine)
        return blocks, self.sync.record_event(self.sync.current_stream())

    async def abort(self, request_id: str, transfer_id: str | None = None) -> None:
        """Stop a request wherever it is, a call of it still waiting for an earlier release
        of the id (``_settled``) included; a stream waiting on it ends with ``abort``.
        ``transfer_id``: the aborted attempt's, whose ``reserve`` is refused should it
        arrive after this."""
        reserved = self._transfers.get(request_id, (None, None))[0]
        if transfer_id is not None and transfer_id != reserved:  # its reserve may be late
            self._aborted_transfers[transfer_id] = None
            while len(self._aborted_transfers) > ABORTED_TRANSFERS_KEPT:
                self._aborted_transfers.popitem(last=False)
        for waiter in self._settling.get(request_id, ()):
            waiter.ended = True  # the gateway's abort comes after that call, never before
        await asyncio.shield(self._end(request_id))

    # -- token feeds: every request of a subscriber streamed through one call -----
    async def feed(self, subscriber: str) -> AsyncIterator[list[FeedItem]]:
        """Stream the deltas of ``subscriber``'s requests (a Ray streaming generator), one
        item per batch of engine steps: a list with a :class:`TokenDelta` (or a
        :class:`StreamError`) per request that moved. Ends the requests still on it when
        the subscriber leaves."""
        feed = self.feeds.get(subscriber)
        try:
            while True:
                yield await feed.next_batch()
        finally:
            await self._drop_feed(subscriber)

    async def start(self, req: DecodeRequest, subscriber: str) -> TokenDelta | None:
        """Start decoding the tokens after ``req.output_token_ids``; their deltas go to
        ``subscriber``'s feed. Returns the finishing delta when the request ends before
        any decode step (token #1 finished it), else ``None``.

        With a descriptor, waits for the KV (bounded) and resumes at token 2;
        without, prefills prompt + tokens so far locally.
        """
        rid = req.request_id
        self.feeds.get(subscriber)  # refused at once if the subscriber has gone
        if not await self._settled(rid):
            raise TransferFailedError(f"{rid}: ended on {self.worker_id} before it started")
        index = 1 if req.descriptor is not None else len(req.output_token_ids)
        self.loop.open_stream(rid, *self.feeds.attach(rid, subscriber, index))
        try:
            if req.descriptor is not None:
                ready = await self._await_transfer(req)
                first = await self._run(lambda e: self._commit(e, rid, req.output_token_ids[0],
                                                               ready))
                if first.finished:
                    self.feeds.detach(rid)
                    return delta_of(rid, [first], 1, include_tokens=False)
            else:  # a re-drive continues the same output
                await self._run(lambda e: e.add_request(rid, req.prompt_token_ids,
                                                        req.sampling_params,
                                                        output_token_ids=req.output_token_ids))
            return None
        except BaseException:
            self.feeds.detach(rid)
            await asyncio.shield(self._end(rid))
            raise

    async def _drop_feed(self, subscriber: str) -> None:
        """Forget a feed (later starts on it are refused) and end the requests still on it."""
        for rid in self.feeds.drop(subscriber):
            await asyncio.shield(self._end(rid))

    def _commit(self, engine, request_id: str, first_token: int, ready) -> EngineOutput:
        """On the engine thread: the compute stream waits for the KV's last write (device-side),
        then the request joins the batch."""
        if ready is not None:
            self.sync.wait_event(self.sync.current_stream(), ready)
        return engine.commit_imported(request_id, first_token)

    async def _await_transfer(self, req: DecodeRequest):
        """Wait (bounded) for the reserved request's KV; on failure release it and raise.
        Returns the event after the KV's last write."""
        rid = req.request_id
        entry = self._transfers.get(rid)
        if entry is None:
            raise TransferFailedError(f"{rid}: no reservation on {self.worker_id}")
        tid, receiver = entry
        pt = await asyncio.to_thread(receiver.wait, tid, self.transfer_timeout_s)
        if self._transfers.get(rid) != entry or rid in self._ending:
            # ended meanwhile (an abort): the release path owns the blocks now
            raise TransferFailedError(f"{rid}: ended on {self.worker_id} while its KV arrived")
        if pt.status != TransferStatus.DONE:
            self.transfer_failures += 1
            self.metrics.kv_transfer_failures.inc()
            await asyncio.shield(self._end(rid))
            raise TransferFailedError(f"{rid}: KV transfer {pt.status.name}: {pt.error}")
        del self._transfers[rid]  # DONE: nothing writes any more
        self._retune_threads()
        receiver.forget(tid)
        self.kv_bytes_received += pt.num_bytes
        self.metrics.kv_transfer_bytes.inc(pt.num_bytes)
        self.metrics.kv_transfer_time.observe(pt.seconds)
        return pt.ready

    # -- one release path ---------------------------------------------------------
    def _end(self, request_id: str) -> asyncio.Task:
        """The request's release task: started once, awaited by every caller."""
        task = self._ending.get(request_id)
        if task is None:
            task = asyncio.ensure_future(self._release(request_id))
            self._ending[request_id] = task
            task.add_done_callback(lambda t: self._forget_task(self._ending, request_id, t))
        return task

    async def _release(self, request_id: str) -> None:
        """Reservation made (or refused) -> transfer aborted, late groups drained -> blocks freed."""
        reserving = self._reserving.get(request_id)
        if reserving is not None:
            with contextlib.suppress(BaseException):
                await reserving
        entry = self._transfers.pop(request_id, None)
        if entry is not None:
            self._retune_threads()
            tid, receiver = entry
            await asyncio.to_thread(receiver.abort, tid)  # returns once no write is in flight
            receiver.forget(tid)
        try:
            out = await self._run(lambda e: e.abort(request_id))
        except Exception as e:  # the engine is gone: its blocks with it
            log.warning("could not free %s on %s: %s", request_id, self.worker_id, e)
            out = None
        if out is not None:
            self.loop.dispatch([out])  # a stream still read ends with ``abort``
        self.feeds.detach(request_id, drop_pending=out is None)

    async def _settled(self, request_id: str) -> bool:
        """Wait for an earlier release of the same request id (a re-drive to this worker);
        False when the gateway aborted the request meanwhile (that abort found the earlier
        release still running). The ends of the earlier attempt itself (its start failing,
        its feed dropped) do not count."""
        ending = self._ending.get(request_id)
        if ending is None:
            return True
        waiter = _Waiter()
        self._settling.setdefault(request_id, []).append(waiter)
        try:
            await asyncio.shield(ending)
        finally:
            waiters = self._settling[request_id]
            waiters.remove(waiter)
            if not waiters:
                del self._settling[request_id]
        return not waiter.ended

    @staticmethod
    def _forget_task(tasks: dict[str, asyncio.Task], request_id: str, task: asyncio.Task) -> None:
        if tasks.get(request_id) is task:
            del tasks[request_id]

    def shutdown(self) -> None:
        self.loop.stop()
        self.leave_transfer_group()
        if self.board is not None:
            self.loop.between_steps = None
            self.board.publish(self._slot, 0)
            self.board.close()

