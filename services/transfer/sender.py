"""Prefill side of the KV protocol: push each layer group of a request to its decode rank.

Jobs run in order on one thread, so a layer group is sent while the engine
computes the next layers. Each payload is preceded by a fixed-size header
naming its transfer id and layer group. Where the blocks form a few long runs
on both sides (``layout.py``), the payload goes out of the cache in place, one
message per (layer, K|V, run); otherwise it is gathered into one message.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.protocol.payload import HEADER_BYTES, LayerGroupHeader, encode_header
from services.transfer.channel import KVChannel
from services.transfer.layout import MIN_RUN_PLANE_BYTES, messages, zero_copy_segments
from services.transfer.staging import StagingBuffer, checksum

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


@dataclass
class SendReport:
    transfer_id: str
    ok: bool
    error: str | None
    num_bytes: int
    seconds: float


class KVSender:
    """Sends jobs FIFO; ``on_done(report)`` fires once per transfer, after its final group
    or its first failure (later groups of a failed transfer are skipped)."""

    def __init__(self, channel: KVChannel,
                 gather: Callable[[Sequence[int], range, torch.Tensor], torch.Tensor],
                 block_shape: Callable[[int, range], tuple[int, ...]], dtype: torch.dtype,
                 on_done: Callable[[SendReport], None],
                 plane: Callable[[int, int, int, int], torch.Tensor] | None = None,
                 plane_block_bytes: int = 0,
                 min_run_plane_bytes: int | None = MIN_RUN_PLANE_BYTES) -> None:
        """``plane`` (the cache's zero-copy view) enables in-place sends of runs whose
        mean plane reaches ``min_run_plane_bytes``; None turns them off."""
        self.channel, self._gather, self._block_shape, self.dtype = channel, gather, block_shape, dtype
        self._plane, self._plane_block_bytes = plane, plane_block_bytes
        self._min_run = min_run_plane_bytes
        self.groups_in_place = self.groups_gathered = 0
        self._on_done = on_done
        self._jobs: queue.SimpleQueue[SendJob | None] = queue.SimpleQueue()
        self._staging = StagingBuffer(channel.device)
        self._header = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=channel.device)
        self._progress: dict[str, tuple[float, int]] = {}  # transfer id -> (start, bytes)
        self._failed: set[str] = set()
        self.bytes_sent = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def submit(self, job: SendJob) -> None:
        if self._closed:  # the group is gone: the transfer fails at once
            if job.final:
                self._on_done(SendReport(job.transfer_id, False, "sender closed", 0, 0.0))
            return
        self._jobs.put(job)

    def close(self) -> None:
        """Stop after the queued jobs (which fail fast once peers have left)."""
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            tid = job.transfer_id
            start, sent = self._progress.setdefault(tid, (time.perf_counter(), 0))
            if tid in self._failed:  # reported already; skip the rest of its groups
                if job.final:
                    self._failed.discard(tid)
                    self._progress.pop(tid, None)
                continue
            try:
                sent += self._send(job)
            except Exception as e:  # dead peer, broken group, timeout
                log.warning("KV send %s group %d failed: %s", tid, job.layer_group, e)
                if not job.final:
                    self._failed.add(tid)
                self._progress.pop(tid, None)
                self._on_done(SendReport(tid, False, f"{type(e).__name__}: {e}", sent,
                                         time.perf_counter() - start))
                continue
            self._progress[tid] = (start, sent)
            if job.final:
                self._progress.pop(tid, None)
                self._on_done(SendReport(tid, True, None, sent, time.perf_counter() - start))

    def _send(self, job: SendJob) -> int:
        sent = self._send_in_place(job)
        if sent is not None:
            return sent
        shape = self._block_shape(len(job.src_block_ids), job.layers)
        data = self._gather(job.src_block_ids, job.layers, self._staging.typed(shape, self.dtype))
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
        self._header.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        self.channel.send(self._header, dst_rank)
