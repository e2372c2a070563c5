"""Attention over the paged KV cache.

``AttentionBackend`` is the seam where a GPU kernel (FlashInfer, flash-attn)
can plug in; ``TorchPagedAttention`` is the portable torch implementation
(SDPA on CPU and CUDA), which hands decode groups to the native CPU kernel
(``cpu_kernels.py``, reading blocks in place) when one is loaded. The runner
builds ``AttentionMetadata`` once per step and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine.model.cpu_kernels import CpuKernels


@dataclass
class AttentionGroup:
    """Sequences with the same padded query length, attended as one SDPA call.

    B sequences, Q padded query rows each, K = max blocks * block size keys.
    """

    token_index: torch.Tensor  # [B, Q] long: flat token row of each query (padding -> 0)
    valid_flat: torch.Tensor | None  # [N] long: which of the B*Q rows are real; None = all
    token_rows: torch.Tensor  # [N] long: flat token row of each real query
    block_table: torch.Tensor  # [B, max_blocks] long (padding -> block 0)
    last_pos: torch.Tensor  # [B] long: position of each sequence's last query
    mask: torch.Tensor | None  # [B, 1, Q, K] bool, True = may attend; None = no masking needed


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each token
    groups: list[AttentionGroup]


class AttentionBackend(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Write ``k, v [T, KVH, D]`` into the caches ``[num_blocks, block_size, KVH, D]``
        at ``meta.slot_mapping``, then attend ``q [T, H, D]`` causally over each
        sequence's cached keys; returns ``[T, H, D]``."""
        ...


class TorchPagedAttention:
    """Gather each group's blocks by block table, then one masked SDPA per group.

    With ``kernels`` (CPU, fp32 activations, fp32 or bf16 KV), decode groups
    skip the gather: the native kernel reads each sequence's blocks where they lie.
    """

    def __init__(self, scale: float, sliding_window: int | None = None,
                 kernels: CpuKernels | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self.kernels = kernels

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        native = self.kernels is not None  # installed only on a CPU model with fp32 activations
        if not native and len(meta.groups) == 1 and meta.groups[0].valid_flat is None \
                and meta.groups[0].token_index.shape[1] == 1:
            return self._group(q, k_cache, v_cache, meta.groups[0])[:, 0]  # pure decode step
        out = q.new_empty(q.shape)  # contiguous even where q is a strided view of qkv
        for g in meta.groups:
            if native and g.token_index.shape[1] == 1:
                self.kernels.paged_decode(q, out, g.token_rows, k_cache, v_cache,
                                          g.block_table, g.last_pos, self.sliding_window,
                                          self.scale)
                continue
            o = self._group(q, k_cache, v_cache, g)  # [B, Q, H, D]
            o = o.reshape(-1, o.shape[2], o.shape[3])
            out[g.token_rows] = o if g.valid_flat is None else o[g.valid_flat]
        return out

    def _group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               g: AttentionGroup) -> torch.Tensor:
        qg = q[g.token_index].transpose(1, 2)  # [B, H, Q, D]
        kg = k_cache[g.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [B, KVH, K, D]
        vg = v_cache[g.block_table].flatten(1, 2).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                           enable_gqa=qg.shape[1] != kg.shape[1])
        return o.transpose(1, 2)  # [B, Q, H, D]
