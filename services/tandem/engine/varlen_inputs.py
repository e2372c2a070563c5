"""A step's inputs for in-place attention kernels, packed into one buffer and copied once.

Token ids, positions, cache slots, the varlen batch (query starts, context
lengths, block table) and the sampling rows all go into one int64 host buffer
(pinned on CUDA), which reaches the device in a single copy; the tensors the
model reads are views of the device buffer. ``VarlenLayout`` fixes where each
part lies, so a CUDA graph captured on one buffer replays on new contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.model.attention import AttentionMetadata, VarlenBatch

# (flat offset of its first query row, first position computed, queries, block ids)
Entry = tuple[int, int, int, Sequence[int]]


@dataclass(frozen=True)
class StepTensors:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_index: torch.Tensor  # [R] int64: rows of the hidden states that sample


@dataclass(frozen=True)
class VarlenLayout:
    """Sizes of the packed buffer: T tokens, B sequences, W block-table columns, R samples."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_samples: int

    @property
    def size(self) -> int:
        t, b = self.num_tokens, self.num_seqs
        return 3 * t + (b + 1) + b + b * self.max_blocks + self.num_samples

    def split(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """``[ids, positions, slots, query_start, context_len, table (flat), sample_index]``."""
        t, b = self.num_tokens, self.num_seqs
        return list(buf[:self.size].split(
            [t, t, t, b + 1, b, b * self.max_blocks, self.num_samples]))

    def tensors(self, buf: torch.Tensor, max_query_len: int) -> StepTensors:
        """The step's tensors as views of ``buf`` (the device copy)."""
        ids, pos, slots, starts, ctx, table, sample = self.split(buf)
        batch = VarlenBatch(query_start=starts, context_len=ctx,
                            block_table=table.view(self.num_seqs, self.max_blocks),
                            max_query_len=max_query_len)
        return StepTensors(ids, pos, AttentionMetadata(slot_mapping=slots, varlen=batch), sample)


def fill(host: np.ndarray, layout: VarlenLayout, entries: Sequence[Entry], ids: Sequence[int],
         positions: Sequence[int], slots: Sequence[int], sample_rows: Sequence[int],
         block_size: int) -> None:
    """Write a step into ``host`` (int64, at least ``layout.size``) in ``layout``.

    Rows past ``len(ids)`` and sequences past ``len(entries)`` are padding: token 0
    at position 0 writing no KV (slot -1), each its own sequence with no context.
    """
    n, b = len(ids), len(entries)
    if n > layout.num_tokens or b > layout.num_seqs or len(sample_rows) > layout.num_samples:
        raise ValueError(f"step of {n} tokens, {b} sequences does not fit {layout}")
    if layout.num_tokens - n != layout.num_seqs - b:
        raise ValueError("padding rows and padding sequences must pair up")
    parts = layout.split(torch.from_numpy(host))
    h_ids, h_pos, h_slots, h_starts, h_ctx, h_table, h_sample = (p.numpy() for p in parts)
    h_ids[:n], h_ids[n:] = ids, 0
    h_pos[:n], h_pos[n:] = positions, 0
    h_slots[:n], h_slots[n:] = slots, -1
    table = h_table.reshape(layout.num_seqs, layout.max_blocks)
    table[:] = 0
    for r, (offset, start, count, blocks) in enumerate(entries):
        h_starts[r] = offset
        h_ctx[r] = start + count
        used = -(-(start + count) // block_size)
        if used > layout.max_blocks:
            raise ValueError(f"a sequence of {start + count} tokens needs {used} blocks, "
                             f"over the table's {layout.max_blocks}")
        table[r, :used] = blocks[:used]
    h_starts[b:] = np.arange(n, n + layout.num_seqs - b + 1)  # one row per padding sequence
    h_ctx[b:] = 0
    h_sample[:len(sample_rows)] = sample_rows
    h_sample[len(sample_rows):] = np.arange(n, n + layout.num_samples - len(sample_rows))


class VarlenInputs:
    """The host staging buffer (pinned on CUDA) and its one copy to the device per step."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self._host = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    def stage(self, layout: VarlenLayout, entries: Sequence[Entry], ids: Sequence[int],
              positions: Sequence[int], slots: Sequence[int],
              sample_rows: Sequence[int]) -> torch.Tensor:
        """The packed step on the host (a view of the staging buffer)."""
        if self._host.numel() < layout.size:
            pinned = self.device.type == "cuda"
            self._host = torch.empty(max(layout.size, 2 * self._host.numel()), dtype=torch.int64,
                                     pin_memory=pinned)
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the buffer
        fill(self._host.numpy(), layout, entries, ids, positions, slots, sample_rows,
             self.block_size)
        return self._host[:layout.size]

    def copy_to(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the staged ``host`` to the device (into ``out`` when given): the step's one copy."""
        if self.device.type != "cuda":
            return host.clone() if out is None else out.copy_(host)
        if out is None:
            out = torch.empty(host.shape, dtype=torch.int64, device=self.device)
        out.copy_(host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def build(self, entries: Sequence[Entry], ids: Sequence[int], positions: Sequence[int],
              slots: Sequence[int], sample_rows: Sequence[int], max_query_len: int) -> StepTensors:
        """Stage, copy once and view an eager (not graphed) step."""
        bs = self.block_size
        width = max((-(-(e[1] + e[2]) // bs) for e in entries), default=0)
        layout = VarlenLayout(len(ids), len(entries), width, len(sample_rows))
        dev = self.copy_to(self.stage(layout, entries, ids, positions, slots, sample_rows))
        return layout.tensors(dev, max_query_len)
