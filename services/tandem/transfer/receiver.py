"""Decode side of the KV protocol: receive layer groups into blocks reserved in advance.

One thread per prefill peer reads header, then payload, in the order that
peer sent them; the header's transfer id and layer group say where the bytes
go. Bytes for a transfer that is unknown or was aborted are drained into
staging and dropped, so the stream stays aligned. A zero-copy payload
(``layout.py``) is received straight into the reserved blocks, run by run. A
transfer's blocks are written only under its lock, so ``abort`` returning
means no write is in flight and the blocks can be freed.

Device order (``device_sync.py``): a peer's receives and scatters are queued on the
channel's stream for that peer (non-blocking: a header receive posted for an
idle peer holds up nothing else). The header is copied to pinned host memory on
that stream and waited for by event, never by a sync another peer's work could
sit behind. Each layer group's writes are waited for (event, bounded) before
the lock is released and the group counted, so DONE and ``abort`` mean the
bytes are in place on the device; ``PendingTransfer.ready`` (the event after
the last write) is what the decode step waits for, device-side, before it reads
the blocks; ``seconds`` is measured between events.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.protocol.messages import TransferStatus
from tandem.protocol.payload import HEADER_BYTES, decode_header
from tandem.transfer.channel import KVChannel
from tandem.transfer.layout import messages, runs_fit
from tandem.transfer.sender import HEARTBEAT_ID
from tandem.transfer.staging import StagingBuffer, checksum, to_device

log = logging.getLogger(__name__)


@dataclass
class PendingTransfer:
    transfer_id: str
    src_rank: int
    block_ids: list[int]
    layer_groups: list[range]
    status: TransferStatus = TransferStatus.WAITING
    error: str | None = None
    received: set[int] = field(default_factory=set)
    num_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # first byte to last, on the device (events) once DONE
    first: Any = None  # timing event before the first group's payload
    ready: Any = None  # event after the last write: the decode step waits for it
    after: Any = None  # the first write waits for it (the blocks' reservation on compute)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


class KVReceiver:
    """Receives from every rank in ``peers`` (the prefill ranks), and from the ranks in
    ``on_demand`` (the decode ranks a request may move from) while a transfer from them is
    expected, and scatters into the local cache.

    An ``on_demand`` peer's thread starts with the first transfer expected from it and ends
    once none is left: no receive stays posted on an idle pair of two decode workers, where
    each side's wait would hold up the other's leaving the group."""

    def __init__(self, channel: KVChannel, peers: Sequence[int],
                 scatter: Callable[[Sequence[int], range, torch.Tensor], None],
                 block_shape: Callable[[int, range], tuple[int, ...]], dtype: torch.dtype,
                 plane: Callable[[int, int, int, int], torch.Tensor] | None = None,
                 plane_block_bytes: int = 0, on_demand: Sequence[int] = ()) -> None:
        self.channel, self._scatter, self._block_shape, self.dtype = channel, scatter, block_shape, dtype
        self.sync = channel.sync
        self._plane, self._plane_block_bytes = plane, plane_block_bytes
        self._pending: dict[str, PendingTransfer] = {}
        self._lock = threading.Lock()
        self.bytes_received = 0
        self.dead_peers: set[int] = set()
        self._on_demand = frozenset(on_demand)
        self._serving: set[int] = set()  # on-demand peers whose thread runs (under _lock)
        for p in peers:
            self._start(p)

    def _start(self, peer: int) -> None:
        threading.Thread(target=self._run, args=(peer,), name=f"kv-recv-{peer}",
                         daemon=True).start()

    def expect(self, transfer_id: str, src_rank: int, block_ids: Sequence[int],
               layer_groups: Sequence[range], after: Any = None) -> PendingTransfer:
        """Register a transfer before its prefill starts (blocks already reserved).

        ``after``: an event on the compute stream recorded once the blocks were reserved;
        the first write into them waits for it (device-side), so no kernel of an earlier
        owner of these blocks still queued there can run after it."""
        if transfer_id == HEARTBEAT_ID:
            raise ValueError(f"{HEARTBEAT_ID!r} is reserved for heartbeats")
        pt = PendingTransfer(transfer_id, src_rank, list(block_ids), list(layer_groups),
                             after=after)
        with self._lock:
            if src_rank in self.dead_peers:
                raise ConnectionError(f"rank {src_rank} is unreachable")
            if self.channel.broken is not None:
                raise ConnectionError(f"the transfer channel is broken: {self.channel.broken}")
            if transfer_id in self._pending:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            self._pending[transfer_id] = pt
            if src_rank in self._on_demand and src_rank not in self._serving:
                self._serving.add(src_rank)
                self._start(src_rank)
        return pt

    def wait(self, transfer_id: str, timeout: float) -> PendingTransfer:
        """Block until the transfer is DONE or FAILED, or ``timeout`` passes (then FAILED)."""
        pt = self._pending.get(transfer_id)
        if pt is None:
            raise KeyError(f"transfer {transfer_id!r} is not expected")
        if not pt.done.wait(timeout):
            self._finish(pt, TransferStatus.FAILED, f"no KV within {timeout:.1f}s")
        return pt

    def abort(self, transfer_id: str) -> None:
        """Stop writing into the transfer's blocks; returns once no write is in flight."""
        pt = self._pending.get(transfer_id)
        if pt is not None:
            self._finish(pt, TransferStatus.ABORTED, "aborted")

    def forget(self, transfer_id: str) -> None:
        """Drop a finished transfer's record (after the caller consumed its status)."""
        with self._lock:
            pt = self._pending.pop(transfer_id, None)
        if pt is not None and pt.status not in (TransferStatus.DONE, TransferStatus.FAILED,
                                                TransferStatus.ABORTED):
            self._finish(pt, TransferStatus.ABORTED, "forgotten")

    def _finish(self, pt: PendingTransfer, status: TransferStatus, error: str | None) -> None:
        with pt.lock:
            if pt.done.is_set():
                return
            pt.status, pt.error = status, error
            pt.seconds = time.perf_counter() - pt.started
            pt.done.set()

    @property
    def broken(self) -> str | None:
        """Why this receiver cannot receive any more (None while healthy); a lost optional
        peer of the channel (a fellow decode worker) only fails the transfers from it."""
        if self.channel.broken is not None:
            return self.channel.broken
        vital = self.dead_peers - self.channel.optional
        if vital:
            return f"lost ranks {sorted(vital)}"
        return None

    def _run(self, peer: int) -> None:
        stream = self.channel.stream(peer)
        with self.sync.use(stream):  # buffers allocated here are reused in this stream's order
            self._serve(peer, stream)

    def _serve(self, peer: int, stream: Any) -> None:
        device, sync = self.channel.device, self.sync
        header_buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
        header_host = torch.empty(HEADER_BYTES, dtype=torch.uint8,
                                  pin_memory=device.type == "cuda")
        staging = StagingBuffer(device)
        while True:
            if peer in self._on_demand and not self._expecting(peer):
                return
            try:
                self.channel.recv(header_buf, peer, idle=True)
                header_host.copy_(header_buf, non_blocking=True)
                self.channel.wait(sync.record_event(stream), f"header from rank {peer}", idle=True)
                header = decode_header(header_host.numpy().tobytes())
                if header.transfer_id == HEARTBEAT_ID:
                    continue
                if header.segments:
                    self._receive_in_place(header, peer, staging, stream)
                    self.bytes_received += header.num_bytes
                    continue
                payload = staging.view(header.num_bytes)
                first = sync.record_event(stream, timing=True)
                self.channel.recv(payload, peer)
                self.bytes_received += header.num_bytes
                self._deliver(header, payload, peer, stream, first)
            except Exception as e:  # the peer died, the group broke, the stream is out of step
                log.warning("KV receive from rank %d stopped: %s", peer, e)
                with self._lock:
                    self.dead_peers.add(peer)
                    lost = list(self._pending.values())
                for pt in lost:
                    if pt.src_rank == peer:
                        self._finish(pt, TransferStatus.FAILED, f"rank {peer} lost: {e}")
                return

    def _expecting(self, peer: int) -> bool:
        """Whether a transfer from the on-demand ``peer`` is still to come; if not, its
        thread ends (under the lock: a transfer expected from now on starts a new one)."""
        with self._lock:
            if any(pt.src_rank == peer and not pt.done.is_set() for pt in self._pending.values()):
                return True
            self._serving.discard(peer)
            return False

    def _after_reservation(self, pt: PendingTransfer, stream: Any) -> None:
        """Before the first write into ``pt``'s blocks (under ``pt.lock``)."""
        if pt.after is not None:
            self.sync.wait_event(stream, pt.after)
            pt.after = None

    def _written(self, pt: PendingTransfer, stream: Any, first: Any, what: str) -> None:
        """Wait (bounded; under ``pt.lock``) until the writes queued so far are on the device."""
        done = self.sync.record_event(stream, timing=True)
        self.channel.wait(done, what)
        pt.first = pt.first if pt.first is not None else first
        pt.ready = done

    def _deliver(self, header, payload: torch.Tensor, peer: int, stream: Any, first: Any) -> None:
        """Write a received gathered payload into its transfer's blocks, or drop it.

        The payload has been read off the channel in full, so whatever is wrong
        with it fails only its transfer; the stream stays aligned.
        """
        pt = self._pending.get(header.transfer_id)
        if pt is None:
            return  # unknown or forgotten: drained
        with pt.lock:
            if pt.done.is_set():
                return  # aborted or timed out: drained
            g = header.layer_group
            error = self._group_error(pt, g, peer)
            if error is None:
                shape = self._block_shape(len(pt.block_ids), pt.layer_groups[g])
                expected = self.dtype.itemsize * math.prod(shape)
                if header.num_bytes != expected:
                    error = f"layer group {g}: {header.num_bytes} bytes, expected {expected}"
            if error is None and header.checksum is not None \
                    and checksum(payload) != header.checksum:
                error = f"checksum mismatch in group {g}"
            if error is None:
                self._after_reservation(pt, stream)
                try:
                    self._scatter(to_device(pt.block_ids, self.channel.device),
                                  pt.layer_groups[g], payload.view(self.dtype).view(shape))
                except Exception as e:  # noqa: BLE001 - fails this transfer only
                    error = f"layer group {g} could not be written: {type(e).__name__}: {e}"
            if error is None:
                self._written(pt, stream, first, f"layer group {g} of {pt.transfer_id}")
            if error is not None:
                log.warning("KV transfer %s failed: %s", pt.transfer_id, error)
                self._fail_locked(pt, error)
                return
            self._group_received(pt, g, header.num_bytes)

    def _receive_in_place(self, header, peer: int, staging: StagingBuffer, stream: Any) -> None:
        """Receive a zero-copy payload into the reserved blocks, or drain it to staging."""
        plan = messages(header.num_bytes, header.segments, self._plane_block_bytes)  # may raise
        pt = self._pending.get(header.transfer_id)
        with pt.lock if pt is not None else contextlib.nullcontext():
            live = pt is not None and not pt.done.is_set()
            error = self._in_place_error(pt, header, len(plan), peer) if live else None
            first_layer = pt.layer_groups[header.layer_group].start if live and not error else 0
            if live and not error:
                self._after_reservation(pt, stream)
            first = self.sync.record_event(stream, timing=True)
            for layer, kv, start, n in plan:
                if live and not error:
                    buf = self._plane(first_layer + layer, kv, pt.block_ids[start], n)
                else:
                    buf = staging.view(n * self._plane_block_bytes)
                self.channel.recv(buf, peer)
            if not live:
                return  # unknown, aborted or timed out: drained
            if error:
                self._fail_locked(pt, error)
                return
            self._written(pt, stream, first, f"layer group {header.layer_group} of {pt.transfer_id}")
            self._group_received(pt, header.layer_group, header.num_bytes)

    @staticmethod
    def _group_error(pt: PendingTransfer, g: int, peer: int) -> str | None:
        """Integrity of a group's arrival: from the expected rank, in range, once."""
        if peer != pt.src_rank:
            return f"layer group {g} came from rank {peer}, expected rank {pt.src_rank}"
        if not 0 <= g < len(pt.layer_groups) or g in pt.received:
            return f"unexpected layer group {g}"
        return None

    def _in_place_error(self, pt: PendingTransfer, header, num_messages: int,
                        peer: int) -> str | None:
        g = header.layer_group
        if (error := self._group_error(pt, g, peer)) is not None:
            return error
        if self._plane is None:
            return "zero-copy payload, but this receiver has no cache planes"
        if not runs_fit(pt.block_ids, header.segments):
            return f"runs {header.segments} do not fit the reserved blocks"
        if num_messages != 2 * len(header.segments) * len(pt.layer_groups[g]):
            return f"layer group {g}: {header.num_bytes} bytes do not match its layers"
        return None

    @staticmethod
    def _fail_locked(pt: PendingTransfer, error: str) -> None:
        """FAILED with ``error`` (caller holds ``pt.lock``; ``_finish`` takes it itself)."""
        pt.status, pt.error = TransferStatus.FAILED, error
        pt.seconds = time.perf_counter() - pt.started
        pt.done.set()

    def _group_received(self, pt: PendingTransfer, group: int, num_bytes: int) -> None:
        """Record a layer group written on the device (under ``pt.lock``); DONE after the last."""
        pt.status = TransferStatus.TRANSFERRING
        pt.received.add(group)
        pt.num_bytes += num_bytes
        if len(pt.received) == len(pt.layer_groups):
            pt.status = TransferStatus.DONE
            pt.seconds = self.sync.elapsed(pt.first, pt.ready)
            pt.done.set()
