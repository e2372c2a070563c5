"""Triton kernels of the CUDA attention path: paged attention read in place, and the KV write.

``paged_attention`` serves every step kind with one kernel: decode (one query
per sequence), speculative verification (k + 1 queries) and prefill or chunked
prefill (many), all as one varlen batch. Each program takes one sequence, one
KV head and a tile of its queries; its rows are (query token, query head of
that KV head's group), so K and V are loaded once per KV head (GQA native) and
read from the cache blocks where they lie, through the block table: no
gathered copy, no padding to the longest sequence, no boolean mask tensor.
Softmax is online (running max and sum in float32).

Importing this module needs triton (``triton_attention`` imports it only on
CUDA). With ``TRITON_INTERPRET=1`` set before its import the kernels run on CPU
tensors under Triton's interpreter, which is how the unit tests check them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, block_size,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: k, v [T, KVH, D] -> cache [blocks, block_size, KVH, D]
    # at its slot; a negative slot (a padding row of a CUDA graph) writes nothing.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # the slot test broadcast to a tensor: newer interpreters refuse a scalar mask operand
    ok = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (h[:, None] * 0 + slot >= 0)
    safe = tl.where(slot >= 0, slot, 0)
    dst = (safe // block_size) * stride_cb + (safe % block_size) * stride_cs \
        + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, hi, pos, seq, kvh, d, d_ok, k_cache_ptr, v_cache_ptr,
                 block_table_ptr, scale, stride_cb, stride_cs, stride_ch, stride_bt, block_size,
                 window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
                 PRECISION: tl.constexpr):
    # One tile of BLOCK_N keys from position ``start``, folded into the running
    # max ``m_i [R]``, sum ``l_i [R]`` and output ``acc [R, D]`` (float32).
    n = start + tl.arange(0, BLOCK_N)  # [N] key positions
    n_ok = n < hi
    page = tl.load(block_table_ptr + seq * stride_bt + n // block_size, mask=n_ok, other=0)
    kv_off = page[:, None] * stride_cb + (n % block_size)[:, None] * stride_cs \
        + kvh * stride_ch + d[None, :]  # [N, D]
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, N]
    allowed = n_ok[None, :] & (n[None, :] <= pos[:, None])
    if SLIDING:
        allowed = allowed & (n[None, :] > pos[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc

@triton.jit
def _paged_attention_kernel(q_ptr, o_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr,
                            query_start_ptr, context_len_ptr, scale,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_cb, stride_cs, stride_ch, stride_bt,
                            block_size, window,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                            LOOP_WHILE: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q0 = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q0
    ctx = tl.load(context_len_ptr + seq)  # keys after this step's writes
    r = tl.arange(0, BLOCK_R)
    tok = tile * BLOCK_M + r // GROUP  # [R] query token within the sequence
    head = kvh * GROUP + r % GROUP  # [R] query head
    row_ok = (r < BLOCK_M * GROUP) & (tok < q_len)
    pos = ctx - q_len + tok  # [R] absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, D]
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    tile_first = ctx - q_len + tile * BLOCK_M  # position of the tile's first query
    hi = tl.minimum(ctx, tile_first + BLOCK_M)  # keys the tile's last query sees
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)
    lo = 0
    if SLIDING:
        lo = tl.maximum(tile_first - window + 1, 0) // BLOCK_N * BLOCK_N
    if LOOP_WHILE:  # the interpreter cannot take a loaded bound in range()
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, hi, pos, seq, kvh, d, d_ok, k_cache_ptr, v_cache_ptr,
                block_table_ptr, scale, stride_cb, stride_cs, stride_ch, stride_bt, block_size,
                window, BLOCK_N, SLIDING, PRECISION)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, hi, pos, seq, kvh, d, d_ok, k_cache_ptr, v_cache_ptr,
                block_table_ptr, scale, stride_cb, stride_cs, stride_ch, stride_bt, block_size,
                window, BLOCK_N, SLIDING, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row with no key: zeros
    tl.store(o_ptr + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k, v [T, KVH, D]`` (last dim contiguous) into ``k_cache, v_cache
    [blocks, block_size, KVH, D]`` at ``slot_mapping [T]``; slots < 0 are skipped."""
    t, kvh, d = k.shape
    if t == 0:
        return
    _check_inner(k, v)
    _check_inner(k_cache, v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout")
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        NUM_KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=_pow2(kvh), BLOCK_D=_pow2(d))


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, query_start: torch.Tensor,
                    context_len: torch.Tensor, max_query_len: int, scale: float,
                    sliding_window: int | None) -> None:
    """Causal attention of ``q [T, H, D]`` into ``out [T, H, D]`` over the paged cache.

    Sequence ``b`` owns query rows ``query_start[b] : query_start[b + 1]`` (``[B + 1]``
    int32), the last of its ``context_len[b]`` positions (``[B]`` int32, keys already
    in the cache), and its blocks ``block_table[b]`` (``[B, max_blocks]`` int32). A
    sequence with no keys (a padding row) gets zeros. ``max_query_len`` sizes the grid.
    """
    num_seqs = context_len.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} KV heads")
    if num_seqs == 0 or max_query_len == 0:
        return
    _check_inner(q, out)
    _check_inner(k_cache, v_cache)
    group = heads // kv_heads
    block_m = 1 if max_query_len == 1 else max(1, 64 // group)
    block_r = max(MIN_DOT, _pow2(block_m * group))
    block_d = max(MIN_DOT, _pow2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    grid = (num_seqs, kv_heads, -(-max_query_len // block_m))
    _paged_attention_kernel[grid](
        q, out, k_cache, v_cache, block_table, query_start, context_len, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        k_cache.shape[1], sliding_window or 0,
        GROUP=group, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_D=block_d, SLIDING=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", LOOP_WHILE=_interpreting())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_inner(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {t.stride()}")
