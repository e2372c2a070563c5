"""Decode steps as CUDA graphs, captured once per batch-size bucket and replayed.

A pure decode step (one query per sequence, no layer hook) of B sequences runs
as the graph of the smallest bucket >= B: its inputs are staged into that
bucket's static device buffer (one host-to-device copy), padding rows (token 0,
no KV write, no context) fill it up, and replay produces the LM-head logits of
every row, of which the first B are used. The attention kernel reads context
lengths and block tables from device memory, so one graph serves any lengths
up to the table width it was captured with (the model's context).

Off CUDA nothing is captured: ``run`` executes the same padded static step
eagerly, which is how the unit tests check the padding and the buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.engine.varlen_inputs import Entry, StepTensors, VarlenInputs, VarlenLayout

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

# static step tensors -> float32 logits [bucket, vocab]
Forward = Callable[[StepTensors], torch.Tensor]


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The capture sizes for batches of at most ``max_batch`` sequences."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    capped = min(max_batch, BUCKETS[-1])  # larger decode batches run eagerly
    return tuple(b for b in BUCKETS if b < capped) + (capped,)


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``batch`` rows; None if none does."""
    return next((b for b in buckets if b >= batch), None)


class DecodeGraphs:
    """One static input buffer and (on CUDA) one captured graph per bucket."""

    def __init__(self, forward: Forward, inputs: VarlenInputs, max_batch: int,
                 max_blocks: int) -> None:
        self.forward = forward
        self.inputs = inputs
        self.device = inputs.device
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = max_blocks
        self.capture = self.device.type == "cuda"
        self._static: dict[int, torch.Tensor] = {}  # bucket -> packed int64 device buffer
        self._logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, V] graph output
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps served from a bucket (graphed or, off CUDA, eager)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def layout(self, bucket: int) -> VarlenLayout:
        return VarlenLayout(bucket, bucket, self.max_blocks, bucket)

    def capture_all(self) -> None:
        """Capture every bucket, largest first, in one memory pool (CUDA only)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            self._capture(bucket, pool)

    def _buffer(self, bucket: int) -> torch.Tensor:
        buf = self._static.get(bucket)
        if buf is None:
            layout = self.layout(bucket)
            host = self.inputs.stage(layout, [], [], [], [], [])  # all padding
            buf = self._static[bucket] = self.inputs.copy_to(host)
        return buf

    def _capture(self, bucket: int, pool: object) -> None:
        tensors = self.layout(bucket).tensors(self._buffer(bucket), max_query_len=1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the kernels and settle the allocator
            for _ in range(2):
                self.forward(tensors)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._logits[bucket] = self.forward(tensors)
        self._graphs[bucket] = graph

    def run(self, entries: Sequence[Entry], ids: Sequence[int], positions: Sequence[int],
            slots: Sequence[int]) -> torch.Tensor:
        """Logits ``[B, V]`` of a pure decode step of ``B = len(entries)`` sequences."""
        bucket = bucket_for(len(entries), self.buckets)
        if bucket is None or len(ids) != len(entries):
            raise ValueError(f"not a decode step of at most {self.max_batch} sequences")
        layout = self.layout(bucket)
        buf = self._buffer(bucket)
        host = self.inputs.stage(layout, entries, ids, positions, slots, range(len(ids)))
        self.inputs.copy_to(host, out=buf)
        self.replays += 1
        graph = self._graphs.get(bucket)
        if graph is None:
            if self.capture:
                raise RuntimeError(f"bucket {bucket} was not captured (call capture_all)")
            return self.forward(layout.tensors(buf, max_query_len=1))[:len(entries)]
        graph.replay()
        return self._logits[bucket][:len(entries)]
