"""Attention over the paged KV cache.

``AttentionBackend`` is the seam where a kernel plugs in. ``TorchPagedAttention``
is the CPU path: the native kernels (``cpu_kernels.py``, reading blocks in place)
for decode groups and, where the CPU has AVX-512 or AVX2 + FMA, prompt groups, when
they are loaded (with AMX, prompts over a bf16 cache take the AMX kernel); SDPA over
gathered blocks otherwise. ``TritonPagedAttention``
(``triton_attention.py``) is the CUDA path, reading blocks in place for every
step kind. The runner builds ``AttentionMetadata`` once per step, in the form
the backend asks for (``uses_varlen``), and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.engine.kernels import cpu_features
from tandem.engine.kernels.cpu_kernels import CpuKernels

@dataclass
class AttentionGroup:
    """Sequences with the same padded query length, attended in one call (a native
    kernel's, or one SDPA).

    B sequences, Q padded query rows each, K = max blocks * block size keys.
    """

    token_index: torch.Tensor  # [B, Q] long: flat token row of each query (padding -> 0)
    valid_flat: torch.Tensor | None  # [N] long: which of the B*Q rows are real; None = all
    token_rows: torch.Tensor  # [N] long: flat token row of each real query
    block_table: torch.Tensor  # [B, max_blocks] long (padding -> block 0)
    last_pos: torch.Tensor  # [B] long: position of each sequence's last query
    mask: torch.Tensor | None  # [B, 1, Q, K] bool, True = may attend; None = causal
    # None mask: every sequence's Q queries are its first Q positions, so plain causal
    # attention over the first Q keys is exact (SDPA skips the upper triangle's tiles)
    first_row: torch.Tensor  # [B] long: flat token row of each sequence's first query
    first_pos: torch.Tensor  # [B] long: position of each sequence's first query
    query_len: torch.Tensor  # [B] long: real queries of each sequence (its rows are consecutive)
    prompt: bool  # prompt chunks (else decode or speculative verify rows)


@dataclass
class VarlenBatch:
    """Every sequence of the step as one varlen batch, for kernels reading blocks in place.

    B sequences; sequence ``b`` owns the flat query rows
    ``query_start[b] : query_start[b + 1]``, which are the last of its
    ``context_len[b]`` positions. Padding rows of a CUDA graph are sequences with
    one query row and no context.
    """

    query_start: torch.Tensor  # [B + 1] int64 prefix sums of query lengths
    context_len: torch.Tensor  # [B] int64: keys in the cache after this step's writes
    block_table: torch.Tensor  # [B, max_blocks] int64 (padding -> block 0)
    max_query_len: int  # host int: sizes the kernel grid


@dataclass
class AttentionMetadata:
    # [T] long: cache slot (block * block_size + offset) of each token; -1 (varlen
    # only): a padding row whose K/V is not written
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup] = field(default_factory=list)  # backends without uses_varlen
    varlen: VarlenBatch | None = None  # backends with uses_varlen

    def decode_group(self) -> AttentionGroup | None:
        """The step's one group when it is a pure decode step (one query row per sequence,
        none padded), else None."""
        if len(self.groups) != 1:
            return None
        g = self.groups[0]
        return g if not g.prompt and g.valid_flat is None and g.token_index.shape[1] == 1 else None


class AttentionBackend(Protocol):
    # True: attends from ``meta.varlen`` (the runner builds no groups); False: from
    # ``meta.groups``.
    uses_varlen: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Write ``k, v [T, KVH, D]`` into the caches ``[num_blocks, block_size, KVH, D]``
        at ``meta.slot_mapping``, then attend ``q [T, H, D]`` causally over each
        sequence's cached keys; returns ``[T, H, D]``."""
        ...


class TorchPagedAttention:
    """Gather each group's blocks by block table, then one masked SDPA per group.

    With ``kernels`` (CPU, fp32 activations, fp32 or bf16 KV), no group is gathered:
    native kernels read each sequence's blocks where they lie, one for decode rows and
    one for prompt chunks (where the CPU and head size allow; SDPA otherwise), a chunk of
    one row too: the decode kernel's sums differ from the prompt kernel's in the last
    bits, and a prompt row's result must not depend on the chunk it fell in.

    With ``amx_prompts`` (default: the CPU has AMX bf16 tiles), prompt groups over a bf16
    cache run their products in bf16 on AMX: the native AMX kernel where it is loaded
    (reading blocks in place; faster on prompts than torch's bf16 SDPA over gathered blocks
    and than the native fp32 math: services/RESULTS.md, "Prompt attention over a bf16 cache
    on AMX"); without native kernels, one bf16
    SDPA (whose sums can follow the chunk). Every prompt group does, whatever its rows (a
    chunk of one row too): a prompt row's result must not depend on the chunk it fell in
    (the prefix cache's hits and the token budget cut chunks anywhere), and the bf16
    products round what the fp32 math does not. Decode and speculative verify rows keep
    the native fp32 kernels, so verifying a draft computes what plain decoding does; so do
    prompts whose head size the AMX kernel does not take. A token's KV is computed as the
    row it was: a generated token's, cached and reused in a later prompt (a chat's next
    turn), or recomputed as a prompt row after a preemption, can differ from the other's
    in bf16 roundings.
    """

    uses_varlen = False

    def __init__(self, scale: float, sliding_window: int | None = None,
                 kernels: CpuKernels | None = None, amx_prompts: bool | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self.kernels = kernels
        self.amx_prompts = cpu_features.has_amx_bf16() if amx_prompts is None else amx_prompts

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        native = self.kernels is not None  # installed only on a CPU model with fp32 activations
        if native:
            self.kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        decode = None if native else meta.decode_group()
        if decode is not None:
            return self._group(q, k_cache, v_cache, decode)[:, 0]  # pure decode step
        out = q.new_empty(q.shape)  # contiguous even where q is a strided view of qkv
        bf16_prompts = self.amx_prompts and k_cache.dtype == torch.bfloat16
        for g in meta.groups:
            amx = bf16_prompts and g.prompt
            if native and amx and not self.kernels.prefill_supported(head_dim, amx=True):
                amx = False  # the native fp32 math, as decode rows: a bf16 SDPA's sums follow the chunk
            prefill = native and self.kernels.prefill_supported(head_dim, amx)
            # one-row groups on the decode kernel, but a prompt's as its other chunks compute
            if native and g.token_index.shape[1] == 1 and not (g.prompt and prefill):
                self.kernels.paged_decode(q, out, g.token_rows, k_cache, v_cache,
                                          g.block_table, g.last_pos, self.sliding_window,
                                          self.scale)
                continue
            if prefill:
                self.kernels.paged_prefill(q, out, g.first_row, g.first_pos, g.query_len,
                                           k_cache, v_cache, g.block_table,
                                           self.sliding_window, self.scale, amx)
                continue
            # SDPA over the gathered blocks: in bf16 on the AMX tiles, else in q's dtype
            o = self._group(q, k_cache, v_cache, g,
                            torch.bfloat16 if amx else None)  # [B, Q, H, D]
            o = o.reshape(-1, o.shape[2], o.shape[3])
            out[g.token_rows] = o if g.valid_flat is None else o[g.valid_flat]
        return out

    def _group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               g: AttentionGroup, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One SDPA over the group's gathered blocks, computed in ``dtype`` (default: q's);
        returns ``[B, Q, H, D]`` in q's dtype."""
        dtype = dtype or q.dtype
        qg = q[g.token_index].transpose(1, 2).to(dtype)  # [B, H, Q, D]
        keys = None if g.mask is not None else qg.shape[2]  # causal: the first Q keys
        kg = k_cache[g.block_table].flatten(1, 2)[:, :keys].transpose(1, 2).to(dtype)  # [B, KVH, K, D]
        vg = v_cache[g.block_table].flatten(1, 2)[:, :keys].transpose(1, 2).to(dtype)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                           is_causal=g.mask is None,
                                           enable_gqa=qg.shape[1] != kg.shape[1])
        return o.transpose(1, 2).to(q.dtype)  # [B, Q, H, D]
