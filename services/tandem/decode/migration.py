"""Both ends of moving a running request to another decode worker with its KV (pre-copy).

Source: ``migrate_begin`` (``decoding ──migrate──▶ migrating_out``: which blocks are
full), ``migrate_send`` (a round of blocks to the destination over the transfer group;
the request decodes on while the full ones go), ``migrate_pause`` (out of the batch:
its outputs and how many blocks hold KV), then ``migrate_done`` (the destination
committed: released, with no abort on its stream) or ``migrate_rollback`` (back into
the batch where it left off). Until ``migrate_done`` the source owns the request.

Destination: ``migrate_in`` (``reserving ──migration_reserved──▶ migrating_in``: blocks
for its tokens plus headroom, the pre-copy round expected), ``migrate_expect`` (the
pre-copy arrived; the last round expected, the reservation grown if it decoded past
it), then ``start`` with a ``DecodeRequest`` marked ``migrated`` commits it
(``migrating_in ──commit──▶ decoding``) and streams from the token after its outputs.

A round is one transfer of the KV protocol (one layer group of every layer over a run
of blocks): the same channel, headers, integrity checks and receiver as a prompt's KV.
The router's driver runs the steps (``router/migration.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from tandem.common.sampling_params import SamplingParams
from tandem.decode.lifecycle import DecodeEvent as E, DecodeState as S, HeldRequest
from tandem.engine.kv_cache.kv_manager import blocks_needed
from tandem.engine.sequence import SequenceStatus
from tandem.protocol.messages import KVTransferDescriptor, LayerRange, TransferStatus
from tandem.protocol.request_path import DecodeRequest
from tandem.transfer.sender import SendJob, SendReport


class MigrationError(RuntimeError):
    """A move could not go on (the request is not movable now, a round failed); the
    request stays where it was."""


@dataclass
class Outbound:
    """The source's record of a move: the full blocks at its start, the preemption count
    that vouches they were not freed since, the rounds still reading its blocks (asyncio
    futures; kept past a rollback and into a later move, until each is off this worker)."""

    blocks: list[int]
    preemptions: int
    rounds: set = field(default_factory=set)
    moved: bool = False  # the destination committed it: released without an abort


@dataclass
class Inbound:
    src_rank: int


class MigrationEnds:
    """Mixed into ``DecodeWorker``: the calls above, on the worker's own state
    (``requests``, ``receiver``, ``sender``, the engine loop)."""

    # -- source ------------------------------------------------------------------------
    async def migrate_begin(self, request_id: str) -> dict:
        """Start moving a decoding request: ``{"num_tokens", "num_full_blocks"}``."""
        req = self._held(request_id, S.DECODING)
        if self.sender is None or self.transfer_broken() is not None:
            raise MigrationError(f"{self.worker_id} cannot send KV to another decode worker")

        def begin(engine):
            seq = self._decoding_seq(engine, request_id)
            full = seq.num_computed_tokens // engine.kv_cache.block_size
            return list(seq.block_ids[:full]), seq.num_preemptions, seq.num_tokens

        blocks, preemptions, num_tokens = await self._run(begin)
        if not self._move(req, E.MIGRATE):
            raise MigrationError(f"{request_id} ended on {self.worker_id} as its move began")
        last = req.migration  # a move rolled back: a round of it may still be reading
        req.migration = Outbound(blocks, preemptions,
                                 last.rounds if isinstance(last, Outbound) else set())
        return {"num_tokens": num_tokens, "num_full_blocks": len(blocks)}

    async def migrate_send(self, request_id: str, desc: KVTransferDescriptor,
                           first_block: int) -> int:
        """Send the request's blocks from ``first_block`` on into ``desc.block_ids`` on
        ``desc.dst_rank``; returns the bytes sent once they are off this worker."""
        req = self._held(request_id, S.MIGRATING_OUT)
        out: Outbound = req.migration
        n = len(desc.block_ids)

        def blocks(engine):
            seq = engine.scheduler.get(request_id)
            if seq is None:
                raise MigrationError(f"{request_id} ended on {self.worker_id}")
            if seq.num_preemptions != out.preemptions:
                raise MigrationError(f"{request_id} was preempted on {self.worker_id}")
            src = list(seq.block_ids[first_block:first_block + n])
            if len(src) != n:
                raise MigrationError(f"{request_id} holds {len(seq.block_ids)} blocks, "
                                     f"{first_block + n} asked for")
            return src, self.sync.record_event(self.sync.current_stream())

        src, ready = await self._run(blocks)
        if self.requests.get(request_id) is not req or req.state is not S.MIGRATING_OUT:
            # ended (or rolled back) meanwhile: its release may not wait for a round begun now
            raise MigrationError(f"{request_id} stopped moving out of {self.worker_id}")
        sent = asyncio.get_running_loop().create_future()
        out.rounds.add(sent)
        sent.add_done_callback(out.rounds.discard)
        self._sends[desc.transfer_id] = sent
        self.sender.submit(SendJob(desc.transfer_id, desc.dst_rank, src,
                                   range(self.engine.model_config.num_layers), 0, final=True,
                                   with_checksum=desc.checksum, dst_block_ids=desc.block_ids,
                                   ready=ready))
        report: SendReport = await asyncio.shield(sent)
        if not report.ok:
            raise MigrationError(f"{request_id}: KV round {desc.transfer_id} failed: {report.error}")
        self.metrics.kv_transfer_bytes.inc(report.num_bytes)
        return report.num_bytes

    def _on_migration_sent(self, report: SendReport) -> None:
        """The sender's report of a round (on its completion thread)."""
        fut = self._sends.pop(report.transfer_id, None)
        if fut is not None:
            fut.get_loop().call_soon_threadsafe(
                lambda: fut.done() or fut.set_result(report))

    async def migrate_pause(self, request_id: str) -> dict:
        """Take the request out of the batch for the last round: ``{"output_token_ids",
        "num_computed_tokens", "num_blocks"}`` (the blocks holding KV)."""
        req = self._held(request_id, S.MIGRATING_OUT)
        out: Outbound = req.migration

        def pause(engine):
            seq = self._decoding_seq(engine, request_id)
            if seq.num_preemptions != out.preemptions:
                raise MigrationError(f"{request_id} was preempted on {self.worker_id}")
            engine.pause(request_id)
            return {"output_token_ids": list(seq.output_token_ids),
                    "num_computed_tokens": seq.num_computed_tokens,
                    "num_blocks": blocks_needed(seq.num_computed_tokens,
                                                engine.kv_cache.block_size)}

        return await self._run(pause)

    async def migrate_rollback(self, request_id: str) -> bool:
        """The move failed: the request decodes here again where it left off; False when
        it is not moving out (ended meanwhile)."""
        req = self.requests.get(request_id)
        if req is None or req.state is not S.MIGRATING_OUT:  # never moving, or ended
            return False
        self._move(req, E.ROLLED_BACK)  # its Outbound stays: a round may still be reading
        await self._run(lambda e: e.resume(request_id))  # after an abort queued first: a no-op
        return True

    async def migrate_done(self, request_id: str) -> None:
        """The destination committed the request: release it here, its stream detached
        (no abort reaches the client), once no round still reads its blocks."""
        req = self._held(request_id, S.MIGRATING_OUT)
        req.migration.moved = True
        await asyncio.shield(self._end(request_id, E.MIGRATED))

    async def _outbound_settled(self, req: HeldRequest) -> bool:
        """Before a release frees its blocks: the round in flight is off this worker.
        Returns whether the request moved (its stream is the destination's now)."""
        out = req.migration
        if not isinstance(out, Outbound):
            return False
        while out.rounds:
            with contextlib.suppress(BaseException):
                await next(iter(out.rounds))
            await asyncio.sleep(0)  # its done callback drops it from ``rounds``
        return out.moved

    # -- destination ---------------------------------------------------------------------
    async def migrate_in(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams, src_rank: int, transfer_id: str,
                         num_tokens: int, num_full_blocks: int,
                         checksum: bool = False) -> KVTransferDescriptor | None:
        """Reserve blocks for ``num_tokens`` tokens of a request moving here from
        ``src_rank`` and expect its first ``num_full_blocks`` blocks; None when full."""
        if transfer_id in self._aborted_transfers:  # the driver gave the move up first
            del self._aborted_transfers[transfer_id]
            raise MigrationError(f"{request_id}: its move was given up before it came")
        if not await self._settled(request_id):
            raise MigrationError(f"{request_id}: ended on {self.worker_id} before its move")
        req = self._open(request_id, S.RESERVING, transfer_id)
        req.migration = Inbound(src_rank)
        task = req.reserving = asyncio.ensure_future(self._reserve_inbound(
            req, prompt_token_ids, params, num_tokens, num_full_blocks, checksum))
        try:
            desc = await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.shield(self._end(request_id, E.STREAM_CLOSED))
            raise
        if desc is not None and req.state is not S.MIGRATING_IN:  # ended meanwhile
            raise MigrationError(f"{request_id}: ended on {self.worker_id} as its blocks "
                                 "were reserved")
        return desc

    async def _reserve_inbound(self, req: HeldRequest, prompt: list[int], params: SamplingParams,
                               num_tokens: int, num_full: int,
                               checksum: bool) -> KVTransferDescriptor | None:
        rid = req.request_id
        receiver = self.receiver
        try:
            if receiver is None or receiver.broken is not None:
                raise MigrationError(f"{self.worker_id} has no working transfer group")

            def reserve(engine):
                blocks = engine.reserve_migration(rid, prompt, params, num_tokens)
                return blocks, self.sync.record_event(self.sync.current_stream())

            blocks, reserved = await self._run(reserve)
        except BaseException:
            self._move(req, E.REFUSED)
            raise
        if blocks is None:
            self._move(req, E.REFUSED)
            return None
        try:
            desc = self._expect_round(req, req.transfer_id, blocks[:num_full], reserved,
                                      checksum)
        except MigrationError:  # the source's rank lost, no transfer group: nothing can write
            await self._run(lambda engine: engine.cancel_reserved(rid))
            self._move(req, E.REFUSED)
            raise
        self._move(req, E.MIGRATION_RESERVED)
        return desc

    def _expect_round(self, req: HeldRequest, transfer_id: str, blocks: list[int], after: Any,
                      checksum: bool) -> KVTransferDescriptor:
        """Register a round into ``blocks`` (none: nothing to receive); ``MigrationError``
        when it cannot be (no transfer group, the source's rank lost)."""
        num_layers = self.engine.model_config.num_layers
        src_rank = req.migration.src_rank
        if blocks:
            receiver = self.receiver
            try:
                if receiver is None:
                    raise ConnectionError(f"{self.worker_id} left the transfer group")
                receiver.expect(transfer_id, src_rank, blocks, [range(num_layers)], after=after)
            except Exception as e:
                raise MigrationError(f"{req.request_id}: {e}") from e
            req.receiver, req.transfer_id = receiver, transfer_id
        return KVTransferDescriptor(
            request_id=req.request_id, transfer_id=transfer_id, block_ids=tuple(blocks),
            layer_groups=(LayerRange(0, num_layers),), src_rank=src_rank, dst_rank=self.rank,
            num_prompt_tokens=0, checksum=checksum)

    async def migrate_expect(self, request_id: str, transfer_id: str, first_block: int,
                             num_blocks: int, num_tokens: int,
                             checksum: bool = False) -> KVTransferDescriptor:
        """Once the pre-copy arrived: expect blocks ``first_block`` to ``first_block +
        num_blocks`` (the last round), the reservation grown to ``num_tokens`` tokens."""
        req = self._held(request_id, S.MIGRATING_IN)
        await self._round_arrived(req)
        blocks = await self._run(lambda e: e.grow_reservation(request_id, num_tokens))
        if req.state is not S.MIGRATING_IN:  # ended meanwhile: its release has run or runs
            raise MigrationError(f"{request_id}: ended on {self.worker_id} before its last round")
        if blocks is None:
            raise MigrationError(f"{self.worker_id} has no room left for {request_id}")
        return self._expect_round(req, transfer_id, blocks[first_block:first_block + num_blocks],
                                  None, checksum)

    async def _round_arrived(self, req: HeldRequest) -> Any:
        """Wait (bounded) for the round registered last; returns the event after its
        last write (None: no round pending)."""
        receiver = req.receiver
        if receiver is None:
            return None
        tid = req.transfer_id
        pt = await asyncio.to_thread(receiver.wait, tid, self.transfer_timeout_s)
        if req.state is not S.MIGRATING_IN:
            raise MigrationError(f"{req.request_id}: ended on {self.worker_id} as its KV arrived")
        if pt.status != TransferStatus.DONE:
            raise MigrationError(f"{req.request_id}: KV round {pt.status.name}: {pt.error}")
        req.receiver = None
        receiver.forget(tid)
        self.kv_bytes_received += pt.num_bytes
        self.metrics.kv_transfer_time.observe(pt.seconds)
        return pt.ready

    async def _start_migrated(self, msg: DecodeRequest, subscriber: str) -> None:
        """``start`` of a request that moved here: its last round waited for, then it
        joins the batch; its deltas go to ``subscriber`` from the token after its outputs."""
        rid = msg.request_id
        req = self._held(rid, S.MIGRATING_IN)
        self.loop.open_stream(rid, *self.feeds.attach(rid, subscriber, len(msg.output_token_ids)))
        try:
            ready = await self._round_arrived(req)
            computed = len(msg.prompt_token_ids) + len(msg.output_token_ids) - 1
            await self._run(lambda e: self._commit_migrated(e, req, msg.output_token_ids,
                                                            computed, ready))
        except BaseException:
            self.feeds.detach(rid)
            await asyncio.shield(self._end(rid, E.STREAM_CLOSED))
            raise

    def _commit_migrated(self, engine, req: HeldRequest, outputs, computed: int, ready) -> None:
        """On the engine thread: after the KV's last write (device-side), into the batch."""
        if not req.move(E.COMMIT):
            raise MigrationError(f"{req.request_id}: ended on {self.worker_id} before it "
                                 "joined the batch")
        if ready is not None:
            self.sync.wait_event(self.sync.current_stream(), ready)
        if not engine.commit_migrated(req.request_id, outputs, computed):
            raise MigrationError(f"{self.worker_id} has no room for {req.request_id}'s next token")

    # -- shared --------------------------------------------------------------------------
    def _held(self, request_id: str, state: S) -> HeldRequest:
        req = self.requests.get(request_id)
        if req is None or req.state is not state:
            now = "not held" if req is None else req.state.name.lower()
            raise MigrationError(f"{request_id} on {self.worker_id} is {now}, not "
                                 f"{state.name.lower()}")
        return req

    def _decoding_seq(self, engine, request_id: str):
        """On the engine thread: the request's sequence, between two decode steps."""
        seq = engine.scheduler.get(request_id)
        if seq is None or seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
            raise MigrationError(f"{request_id} is not decoding on {self.worker_id}")
        return seq
