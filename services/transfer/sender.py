"""Prefill side of the KV protocol: push each layer group of a request to its decode rank.

Jobs run in order on one thread, so a layer group is gathered and sent while
the engine computes the next layers. Each payload is preceded by a fixed-size
header naming its transfer id and layer group.
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
                 on_done: Callable[[SendReport], None]) -> None:
        self.channel, self._gather, self._block_shape, self.dtype = channel, gather, block_shape, dtype
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
        shape = self._block_shape(len(job.src_block_ids), job.layers)
        data = self._gather(job.src_block_ids, job.layers, self._staging.typed(shape, self.dtype))
        payload = data.view(-1).view(torch.uint8)
        header = LayerGroupHeader(
            transfer_id=job.transfer_id, layer_group=job.layer_group,
            num_bytes=payload.numel(), checksum=checksum(payload) if job.with_checksum else None,
            final=job.final)
        self._header.copy_(torch.frombuffer(bytearray(encode_header(header)), dtype=torch.uint8))
        self.channel.send(self._header, job.dst_rank)
        self.channel.send(payload, job.dst_rank)
        self.bytes_sent += payload.numel()
        return payload.numel()
