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
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence

from tandem.common.config import EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import EngineOutput
from tandem.protocol.messages import (KVTransferDescriptor,
                                        TransferStatus, layer_groups)
from tandem.decode.feed import FeedItem, Feeds, delta_of
from tandem.decode.lifecycle import LIFECYCLE, DecodeEvent as E, DecodeState as S, HeldRequest
from tandem.decode.migration import MigrationEnds
from tandem.protocol.request_path import DecodeRequest, TokenDelta
from tandem.transfer.endpoint import make_receiver, make_sender, open_channel
from tandem.transfer.receiver import KVReceiver
from tandem.transfer.sender import KVSender
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


class DecodeWorker(MigrationEnds, EngineWorker):
    """Wrap with ``ray.remote`` (async actor); one engine, one receiver.

    Each request it holds is one :class:`HeldRequest` in ``requests``, moved through
    its lifecycle (``decode/lifecycle.py``) by the table there. One owner, one order for a
    remote-prefill request's blocks: ``reserve`` takes them (RESERVED in the scheduler)
    and registers the transfer; the transfer ends DONE (the request joins the batch) or
    is aborted, after which no write into the blocks is in flight and later groups are
    drained; only then are the blocks freed. Every way a request ends (``abort``, its
    feed closed at any point, a failed or timed-out transfer, cancellation during
    ``reserve``) goes through :meth:`_end`: one release task per request, which later
    callers await. A running request moves to another decode worker with its KV by the
    calls of :class:`MigrationEnds` (``decode/migration.py``).
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
        self.sender: KVSender | None = None  # to the other decode workers (migration)
        self._sends: dict[str, asyncio.Future] = {}  # migration rounds in flight, by transfer id
        self.rank: int | None = None
        self.transfer_timeout_s = transfer_timeout_s
        self.requests: dict[str, HeldRequest] = {}  # the attempt held of each request id
        # transfer ids of attempts aborted before this worker saw them; a reserve that
        # arrives after its own abort (an async actor runs calls in no set order) is
        # refused instead of holding blocks
        self._aborted_transfers: OrderedDict[str, None] = OrderedDict()
        self.feeds = Feeds(worker_id, self.loop.close_stream, on_ended=self._stream_ended)
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
            pending = self._pending_transfers()  # now: the commands apply in the order queued
            self.loop.submit(lambda e: self.threads.apply(pending))

    def join_transfer_group(self, transports: Mapping[int, str], world_size: int, rank: int,
                            group_name: str, prefill_ranks: Sequence[int],
                            timeout_ms: int = 30_000, op_timeout_s: float = 30.0) -> int:
        """Become ``rank`` of the transfer group, receiving from ``prefill_ranks`` over the
        transports named in ``transports``; returns once every pair is connected. The
        other decode ranks among ``transports`` are the peers requests move to and from
        (optional: losing one fails only the moves with it)."""
        peers = [p for p in transports if p not in prefill_ranks]
        channel = open_channel(transports, world_size, rank, group_name, self.sync,
                               senders=[*prefill_ranks, *(p for p in peers if p < rank)],
                               timeout_ms=timeout_ms, op_timeout_s=op_timeout_s, optional=peers)
        self.receiver = make_receiver(channel, self.engine, prefill_ranks, on_demand=peers)
        if peers:  # no heartbeats: a lost peer fails a move, and an idle pair costs nothing
            self.sender = make_sender(channel, self.engine, self._on_migration_sent,
                                      receivers=peers, heartbeat_s=None)
        self.rank = rank
        return rank

    def leave_transfer_group(self) -> None:
        """Leave the group; transfers still in flight fail (and their requests are re-driven)."""
        sender, self.sender = self.sender, None
        if self.receiver is not None:
            receiver, self.receiver = self.receiver, None
            receiver.channel.close()
        if sender is not None:
            sender.close()

    def transfer_broken(self) -> str | None:
        receiver = self.receiver
        if receiver is None:
            return "left the transfer group" if self.rank is not None else None
        return receiver.broken

    def _pending_transfers(self) -> int:
        """Transfers that may still write into a request's blocks."""
        return sum(1 for r in self.requests.values() if r.receiver is not None)

    def counters(self) -> dict:
        return {"kv_bytes_received": self.kv_bytes_received,
                "pending_transfers": self._pending_transfers(),
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
        req = self._open(request_id, S.RESERVING, transfer_id)
        task = req.reserving = asyncio.ensure_future(self._reserve(
            req, prompt_token_ids, params, src_rank, layer_group_size, checksum))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.shield(self._end(request_id, E.STREAM_CLOSED))
            raise

    async def _reserve(self, req: HeldRequest, prompt_token_ids: Sequence[int],
                       params: SamplingParams, src_rank: int, layer_group_size: int | None,
                       checksum: bool) -> KVTransferDescriptor | None:
        request_id, transfer_id = req.request_id, req.transfer_id
        receiver = self.receiver
        if receiver is None or receiver.broken is not None:
            self._move(req, E.REFUSED)
            raise TransferFailedError(f"decode worker {self.worker_id} has no working transfer "
                                      f"group ({receiver.broken if receiver else 'not joined'})")
        try:
            blocks, reserved = await self._run(lambda e: self._reserve_blocks(
                e, request_id, prompt_token_ids, params))
        except BaseException:
            self._move(req, E.REFUSED)  # nothing held (or, cancelled, the release frees it)
            raise
        if blocks is None:
            self._move(req, E.REFUSED)
            return None
        groups = layer_groups(self.engine.model_config.num_layers, layer_group_size)
        try:
            receiver.expect(transfer_id, src_rank, blocks, [g.layers for g in groups],
                            after=reserved)
        except Exception as e:
            await self._run(lambda e: e.cancel_reserved(request_id))  # nothing can write yet
            self._move(req, E.REFUSED)
            raise TransferFailedError(f"{request_id}: {e}") from e
        req.receiver = receiver  # an abort meanwhile (RELEASING) aborts it: its release waits for us
        self._move(req, E.RESERVED)
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
        req = self.requests.get(request_id)
        registered = req.transfer_id if req is not None and req.receiver is not None else None
        if transfer_id is not None and transfer_id != registered:  # its reserve may be late
            self._aborted_transfers[transfer_id] = None
            while len(self._aborted_transfers) > ABORTED_TRANSFERS_KEPT:
                self._aborted_transfers.popitem(last=False)
        for waiter in req.waiters if req is not None else ():
            waiter.ended = True  # the gateway's abort comes after that call, never before
        await asyncio.shield(self._end(request_id, E.ABORT))

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
        if req.migrated:
            await self._start_migrated(req, subscriber)
            return None
        if req.descriptor is None and rid in self.requests:
            raise TransferFailedError(f"{rid}: already held on {self.worker_id}")
        self.loop.open_stream(rid, *self.feeds.attach(rid, subscriber, index))
        if req.descriptor is None:  # a re-drive (or a short prompt) prefilled here
            self._open(rid, S.DECODING)
        try:
            if req.descriptor is not None:
                record, ready = await self._await_transfer(req)
                first = await self._run(lambda e: self._commit(e, record, req.output_token_ids[0],
                                                               ready))
                if first.finished:
                    self._move(record, E.FINISHED)
                    self.feeds.detach(rid)
                    return delta_of(rid, [first], 1, include_tokens=False)
            else:  # a re-drive continues the same output
                await self._run(lambda e: e.add_request(rid, req.prompt_token_ids,
                                                        req.sampling_params,
                                                        output_token_ids=req.output_token_ids))
            return None
        except BaseException:
            self.feeds.detach(rid)
            await asyncio.shield(self._end(rid, E.STREAM_CLOSED))
            raise

    async def _drop_feed(self, subscriber: str) -> None:
        """Forget a feed (later starts on it are refused) and end the requests still on it."""
        for rid in self.feeds.drop(subscriber):
            await asyncio.shield(self._end(rid, E.CLIENT_GONE))

    def _commit(self, engine, req: HeldRequest, first_token: int, ready) -> EngineOutput:
        """On the engine thread: the compute stream waits for the KV's last write (device-side),
        then the request joins the batch; refused when it ended meanwhile (the release,
        queued behind this on the engine thread, then frees the reserved blocks)."""
        if not req.move(E.COMMIT):
            raise TransferFailedError(f"{req.request_id}: ended on {self.worker_id} before it "
                                      "joined the batch")
        if ready is not None:
            self.sync.wait_event(self.sync.current_stream(), ready)
        return engine.commit_imported(req.request_id, first_token)

    async def _await_transfer(self, msg: DecodeRequest):
        """Wait (bounded) for the reserved request's KV; on failure release it and raise.
        Returns the request and the event after the KV's last write."""
        rid = msg.request_id
        req = self.requests.get(rid)
        tid = msg.descriptor.transfer_id
        if req is None or req.transfer_id != tid or req.receiver is None or not req.move(E.START):
            raise TransferFailedError(f"{rid}: no reservation on {self.worker_id}")
        receiver = req.receiver
        started = time.monotonic()
        pt = await asyncio.to_thread(receiver.wait, tid, self.transfer_timeout_s)
        if req.state is not S.RECEIVING:
            # ended meanwhile (an abort): the release path owns the blocks now
            raise TransferFailedError(f"{rid}: ended on {self.worker_id} while its KV arrived")
        if pt.status != TransferStatus.DONE:
            self.transfer_failures += 1
            self.metrics.kv_transfer_failures.inc()
            late = time.monotonic() - started >= self.transfer_timeout_s
            await asyncio.shield(self._end(rid, E.TIMEOUT if late else E.TRANSFER_FAILED))
            raise TransferFailedError(f"{rid}: KV transfer {pt.status.name}: {pt.error}")
        req.receiver = None  # DONE: nothing writes any more
        self._move(req, E.ALL_ARRIVED)
        self._retune_threads()
        receiver.forget(tid)
        self.kv_bytes_received += pt.num_bytes
        self.metrics.kv_transfer_bytes.inc(pt.num_bytes)
        self.metrics.kv_transfer_time.observe(pt.seconds)
        return req, pt.ready

    # -- the requests held, and one release path ------------------------------------
    def _open(self, request_id: str, state: S, transfer_id: str | None = None) -> HeldRequest:
        """A new attempt of ``request_id``; refused while another attempt of it is held
        (an earlier one's release is awaited first, by ``_settled``)."""
        if request_id in self.requests:
            raise TransferFailedError(f"{request_id}: already held on {self.worker_id}")
        req = self.requests[request_id] = HeldRequest(request_id, state, transfer_id)
        return req

    def _move(self, req: HeldRequest, event: E) -> bool:
        return LIFECYCLE.move_held(self.requests, req, event)

    def _stream_ended(self, request_id: str) -> None:
        """Its feed sent the request's last delta or error: the engine ended it (its blocks
        freed), unless a release is already doing that."""
        req = self.requests.get(request_id)
        if req is not None and req.state in (S.COMMITTED, S.DECODING, S.MIGRATING_OUT):
            self._move(req, E.FINISHED)

    def _end(self, request_id: str, event: E) -> asyncio.Future:
        """End the request by ``event``: its release task, started once and awaited by every
        caller. A request not held (finished, or known only to the engine) is released all
        the same: the engine drops whatever it still has of it."""
        req = self.requests.get(request_id)
        if req is None:
            req = self._open(request_id, S.DECODING)
        self._move(req, event)
        if req.releasing is None:
            req.releasing = asyncio.ensure_future(self._release(req))
        return req.releasing

    async def _release(self, req: HeldRequest) -> None:
        """Reservation made (or refused) -> transfer aborted, late groups drained -> blocks freed."""
        request_id = req.request_id
        if req.reserving is not None:
            with contextlib.suppress(BaseException):
                await req.reserving
        moved = await self._outbound_settled(req)  # a round still reading its blocks
        if moved:  # its stream goes on from the destination: nothing more of it here
            self.feeds.detach(request_id)
        receiver, req.receiver = req.receiver, None
        if receiver is not None:
            self._retune_threads()
            await asyncio.to_thread(receiver.abort, req.transfer_id)  # once no write is in flight
            receiver.forget(req.transfer_id)
        try:
            out = await self._run(lambda e: e.abort(request_id))
        except Exception as e:  # the engine is gone: its blocks with it
            log.warning("could not free %s on %s: %s", request_id, self.worker_id, e)
            out = None
        self._move(req, E.FREED)
        if out is not None and not moved:
            self.loop.dispatch([out])  # a stream still read ends with ``abort``
        self.feeds.detach(request_id, drop_pending=out is None or moved)

    async def _settled(self, request_id: str) -> bool:
        """Wait for an earlier release of the same request id (a re-drive to this worker);
        False when the gateway aborted the request meanwhile (that abort found the earlier
        release still running). The ends of the earlier attempt itself (its start failing,
        its feed dropped) do not count."""
        req = self.requests.get(request_id)
        if req is None or req.releasing is None:
            return True
        waiter = _Waiter()
        req.waiters.append(waiter)
        try:
            await asyncio.shield(req.releasing)
        finally:
            req.waiters.remove(waiter)
        return not waiter.ended

    def shutdown(self) -> None:
        self.loop.stop()
        for req in list(self.requests.values()):  # the engine's blocks go with it
            req.move(E.SHUTDOWN)
            req.receiver = None
            self._move(req, E.FREED)
        self.leave_transfer_group()
        if self.board is not None:
            self.loop.between_steps = None
            self.board.publish(self._slot, 0)
            self.board.close()

