"""Prefill side of the KV protocol: push each layer group of a request to its decode rank.

Jobs run in order on one thread, so a layer group is sent while the engine
computes the next layers. Each payload is preceded by a fixed-size header
naming its transfer id and layer group. Where the blocks form a few long runs
on both sides (``layout.py``), the payload goes out of the cache in place, one
message per (layer, K|V, run); otherwise it is gathered into one message.

Device order (``device_sync.py``): a job's work is queued on the channel's stream
for its decode rank after that stream waited for the job's ``ready`` event
(recorded on the compute stream when the group's last layer was queued). A
transfer is reported (and its blocks freed) only once an event recorded after
its last send has completed, observed on a completion thread of its own; its
time is measured between events. When idle, the sender sends each peer a
heartbeat header every ``heartbeat_s``, so an idle pair stays warm and a dead
receiver shows within one interval.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.protocol.payload import LayerGroupHeader, encode_header
from tandem.transfer.channel import KVChannel
from tandem.transfer.layout import MIN_RUN_PLANE_BYTES, messages, zero_copy_segments
from tandem.transfer.staging import StagingBuffer, checksum, to_device

HEARTBEAT_ID = "tandem-heartbeat"  # the transfer id of heartbeat headers (never a transfer's)
HEARTBEAT_S = 30.0

log = logging.getLogger(__name__)


@dataclass
class SendJob:
    transfer_id: str
    dst_rank: int
    src_block_ids: Sequence[int]
    layers: range
    layer_group: int
    final: bool  # the request's last group: its blocks may be released after it
    with_checksum: bool = False
    dst_block_ids: Sequence[int] = ()  # the decode side's blocks; () = always gather
    ready: Any = None  # event after which the group's KV is complete (None: it is)
    abandon: str | None = None  # no KV: end the transfer failed, after its queued groups


class TransferAbandoned(RuntimeError):
    """The prefill step stopped between a transfer's groups; the rest will never come."""


@dataclass
class SendReport:
    transfer_id: str
    ok: bool
    error: str | None
    num_bytes: int
    seconds: float


class KVSender:
    """Sends jobs FIFO; ``on_done(report)`` fires once per transfer, after its final group
    completed on the device or its first failure (later groups of a failed transfer are
    skipped). It runs on the completion thread, or on the submitting thread for a
    transfer whose final group comes after ``close``."""

    def __init__(self, channel: KVChannel,
                 gather: Callable[[Sequence[int] | torch.Tensor, range, torch.Tensor], torch.Tensor],
                 block_shape: Callable[[int, range], tuple[int, ...]], dtype: torch.dtype,
                 on_done: Callable[[SendReport], None],
                 plane: Callable[[int, int, int, int], torch.Tensor] | None = None,
                 plane_block_bytes: int = 0,
                 min_run_plane_bytes: int | None = MIN_RUN_PLANE_BYTES,
                 heartbeat_s: float | None = HEARTBEAT_S,
                 receivers: Sequence[int] | None = None) -> None:
        """``plane`` (the cache's zero-copy view) enables in-place sends of runs whose
        mean plane reaches ``min_run_plane_bytes``; None turns them off. ``receivers``:
        the peers it sends to and heartbeats (default: every peer of the channel)."""
        self.channel, self._gather, self._block_shape, self.dtype = channel, gather, block_shape, dtype
        self.sync = channel.sync
        self._plane, self._plane_block_bytes = plane, plane_block_bytes
        self._min_run = min_run_plane_bytes
        self._heartbeat_s = heartbeat_s
        self.receivers = tuple(channel.peers if receivers is None else receivers)
        self.groups_in_place = self.groups_gathered = self.heartbeats = 0
        self._on_done = on_done
        self._jobs: queue.SimpleQueue[SendJob | None] = queue.SimpleQueue()
        self._completions: queue.SimpleQueue[tuple[SendReport, Any, Any] | None] = \
            queue.SimpleQueue()
        self._staging: dict[int, StagingBuffer] = {}  # per decode rank: one stream each
        self._progress: dict[str, tuple[Any, int]] = {}  # transfer id -> (start event, bytes)
        self.bytes_sent = 0
        # guards the three below; no job is queued behind the stop sentinel
        self._lock = threading.Lock()
        self._closed = False
        self._open: set[str] = set()  # transfers submitted and not reported yet
        self._failed: set[str] = set()  # reported failed before their final group came
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._completer = threading.Thread(target=self._complete, name="kv-send-done",
                                           daemon=True)
        self._thread.start()
        self._completer.start()

    def submit(self, job: SendJob) -> None:
        tid = job.transfer_id
        with self._lock:
            if not self._closed:
                if tid not in self._failed:
                    self._open.add(tid)
                self._jobs.put(job)
                return
            if not job.final:
                return
            if tid in self._failed:  # reported already
                self._failed.discard(tid)
                return
            self._open.add(tid)
        self._deliver(SendReport(tid, False, "sender closed", 0, 0.0))  # the group is gone

    def abandon(self, transfer_id: str, dst_rank: int, reason: str) -> None:
        """End a transfer whose later groups will never be submitted: it is reported failed
        once the groups queued before this call are off the device (they still read the
        source blocks, so those must not be freed sooner)."""
        self.submit(SendJob(transfer_id, dst_rank, (), range(0), -1, final=True,
                            abandon=reason))

    def close(self, wait_s: float = 10.0) -> None:
        """Stop after the queued jobs (which fail fast once peers have left), waiting up
        to ``wait_s``. Every transfer submitted is still reported once, even one whose
        send outlasts the wait: the completion thread stops only after the sending one."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout=wait_s)
        self._completer.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        try:
            while True:
                try:
                    job = self._jobs.get(timeout=self._heartbeat_s)
                except queue.Empty:
                    self._heartbeat()
                    continue
                if job is None:
                    return
                try:
                    self._run_job(job)
                except Exception as e:  # noqa: BLE001 - a bug must not strand later transfers
                    log.exception("KV send %s group %d", job.transfer_id, job.layer_group)
                    self._fail(job, e, 0, self._event_after(job))
        finally:
            self._completions.put(None)  # after every completion this thread queued

    def _run_job(self, job: SendJob) -> None:
        tid, sync = job.transfer_id, self.sync
        with self._lock:
            skip = tid in self._failed  # reported already; skip the rest of its groups
            if skip and job.final:
                self._failed.discard(tid)
        if skip:
            return
        try:
            stream = self.channel.stream(job.dst_rank)
        except ValueError as e:  # not a peer of this rank: nothing was queued for it
            self._fail(job, e, 0, None)
            return
        if job.abandon is not None:
            _, sent = self._progress.get(tid) or (None, 0)
            self._fail(job, TransferAbandoned(job.abandon), sent, self._event_after(job))
            return
        with sync.use(stream):
            if job.ready is not None:
                sync.wait_event(stream, job.ready)  # device-side: after the layer's compute
            start, sent = self._progress.get(tid) or (sync.record_event(stream, timing=True), 0)
            try:
                sent += self._send(job)
            except Exception as e:  # dead peer, broken group, timeout
                log.warning("KV send %s group %d failed: %s", tid, job.layer_group, e)
                # freed once the sends already queued for it are off the device
                self._fail(job, e, sent, sync.record_event(stream))
                return
            self._progress[tid] = (start, sent)
            if job.final:
                self._progress.pop(tid, None)
                end = sync.record_event(stream, timing=True)
                self._completions.put((SendReport(tid, True, None, sent, 0.0), start, end))

    def _fail(self, job: SendJob, error: Exception, sent: int, end: Any) -> None:
        """Report ``job``'s transfer failed (once ``end`` completed); skip its later groups."""
        tid = job.transfer_id
        if not job.final:
            with self._lock:
                self._failed.add(tid)
        self._progress.pop(tid, None)
        self._completions.put((SendReport(tid, False, f"{type(error).__name__}: {error}", sent,
                                          0.0), None, end))

    def _event_after(self, job: SendJob) -> Any:
        """An event after whatever was queued for ``job``'s peer; None without a stream."""
        try:
            return self.sync.record_event(self.channel.stream(job.dst_rank))
        except Exception:  # noqa: BLE001 - no stream: nothing was queued
            return None

    def _deliver(self, report: SendReport) -> None:
        """``on_done(report)`` unless the transfer was reported already."""
        with self._lock:
            if report.transfer_id not in self._open:
                return
            self._open.discard(report.transfer_id)
        try:
            self._on_done(report)
        except Exception:  # noqa: BLE001 - one report must not stop the others
            log.exception("KV send report for %s failed", report.transfer_id)

    def _complete(self) -> None:
        """Report each transfer once its sends completed on the device (FIFO: the events
        of one stream complete in order; a wait is bounded by the channel's deadline)."""
        while (item := self._completions.get()) is not None:
            report, start, end = item
            try:
                if end is not None:
                    self.channel.wait(end, f"KV send of {report.transfer_id}")
                if start is not None:
                    report.seconds = self.sync.elapsed(start, end)
            except Exception as e:  # the channel broke: its communicators are gone
                if report.ok:
                    report.ok, report.error = False, f"{type(e).__name__}: {e}"
            self._deliver(report)

    def _heartbeat(self) -> None:
        """An empty header to every peer; a failure breaks the channel (the receiver is gone)."""
        header = encode_header(LayerGroupHeader(transfer_id=HEARTBEAT_ID, layer_group=0,
                                                num_bytes=0))
        for peer in self.receivers:
            if self.channel.broken is not None:
                return
            if peer in self.channel.lost:
                continue
            try:
                with self.sync.use(self.channel.stream(peer)):
                    self.channel.send(to_device(header, self.channel.device), peer)
                self.heartbeats += 1
            except Exception as e:  # noqa: BLE001 - the channel is broken now; health says so
                log.warning("KV heartbeat to rank %d failed: %s", peer, e)

    def _staging_for(self, peer: int) -> StagingBuffer:
        staging = self._staging.get(peer)
        if staging is None:  # allocated on the peer's stream: reuse is ordered on it
            staging = self._staging[peer] = StagingBuffer(self.channel.device)
        return staging

    def _send(self, job: SendJob) -> int:
        sent = self._send_in_place(job)
        if sent is not None:
            return sent
        shape = self._block_shape(len(job.src_block_ids), job.layers)
        src = to_device(job.src_block_ids, self.channel.device)  # no pageable copy, no sync
        data = self._gather(src, job.layers,
                            self._staging_for(job.dst_rank).typed(shape, self.dtype))
        payload = data.view(-1).view(torch.uint8)
        header = LayerGroupHeader(
            transfer_id=job.transfer_id, layer_group=job.layer_group,
            num_bytes=payload.numel(), checksum=checksum(payload) if job.with_checksum else None,
            final=job.final)
        self._send_header(encode_header(header), job.dst_rank)
        self.channel.send(payload, job.dst_rank)
        self.bytes_sent += payload.numel()
        self.groups_gathered += 1
        return payload.numel()

    def _send_in_place(self, job: SendJob) -> int | None:
        """Zero-copy send of the group's runs; None when the job should be gathered."""
        if self._plane is None or self._min_run is None or job.with_checksum \
                or not job.dst_block_ids:
            return None
        segments = zero_copy_segments(job.src_block_ids, job.dst_block_ids,
                                      self._plane_block_bytes, self._min_run)
        if not segments:
            return None
        num_bytes = len(job.layers) * 2 * len(job.src_block_ids) * self._plane_block_bytes
        try:
            header = encode_header(LayerGroupHeader(
                transfer_id=job.transfer_id, layer_group=job.layer_group, num_bytes=num_bytes,
                final=job.final, segments=segments))
        except ValueError:  # a transfer id too long to leave room for the runs
            return None
        self._send_header(header, job.dst_rank)
        src = job.src_block_ids
        for layer, kv, start, n in messages(num_bytes, segments, self._plane_block_bytes):
            self.channel.send(self._plane(job.layers.start + layer, kv, src[start], n),
                              job.dst_rank)
        self.bytes_sent += num_bytes
        self.groups_in_place += 1
        return num_bytes

    def _send_header(self, encoded: bytes, dst_rank: int) -> None:
        self.channel.send(to_device(encoded, self.channel.device), dst_rank)
