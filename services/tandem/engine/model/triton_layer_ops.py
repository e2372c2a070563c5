"""The elementwise steps of a decoder layer as one Triton kernel each (the CUDA path).

A decode step is launch-bound: in torch, residual add + RMSNorm is about seven
kernels, RoPE on q and k about a dozen, SiLU-and-mul three. Here each is one
kernel that rounds as ``TorchLayerOps`` does (HF transformers' order: the
norm in float32, each torch op's result rounded to the model dtype), so bf16
outputs match torch's to the last bit or one rounding, float32 within float32
rounding. ``ModelRunner`` installs them with the Triton attention backend.

Every launch turns floating-point contraction off (``NO_FMA``): with it on, the
compiler fuses RoPE's ``x * cos`` into the following add as one FMA, which
skips the product's rounding to the model dtype, and many outputs differed from
torch's (by up to a bf16 ulp of the terms, far more ulps of a result that cancels
to zero), in bf16 and fp16 alike.

Importing this module needs triton; ``TRITON_INTERPRET=1`` before that runs the
kernels on CPU tensors, which is how the unit tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.model.layer_ops import TorchLayerOps
from tandem.engine.model.rope import RotaryEmbedding


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, x_out_ptr, h_out_ptr, stride_x, stride_d, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    # One row of [T, n]: x_out = x + delta (rounded), h_out = RMSNorm(x_out) * weight.
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * stride_d + c, mask=ok,
                                         other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_out_ptr + row * n + c, x, mask=ok)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_out_ptr + row * n + c, (normed * w).to(x.dtype), mask=ok)


@triton.jit
def _rope_rows(src_ptr, dst_ptr, stride_t, stride_h, row, heads, cos, sin, d, sign, partner,
               BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr):
    # x * cos + rotate_half(x) * sin for every head of one token; dst [T, heads, D] contiguous.
    h = tl.arange(0, BLOCK_H)
    ok = (h[:, None] < heads) & (d[None, :] < HEAD_DIM)
    base = src_ptr + row * stride_t + h[:, None] * stride_h
    x = tl.load(base + d[None, :], mask=ok, other=0.0)
    rot = sign[None, :] * tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * cos[None, :]).to(x.dtype).to(tl.float32)
    b = (rot.to(x.dtype).to(tl.float32) * sin[None, :]).to(x.dtype).to(tl.float32)
    tl.store(dst_ptr + row * heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :],
             (a + b).to(x.dtype), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, q_heads, k_heads,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
                 BLOCK_HK: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.load(pos_ptr + row)
    d = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    sign = tl.where(d < half, -1.0, 1.0)
    partner = tl.where(d < half, d + half, d - half)
    d_ok = d < HEAD_DIM
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    _rope_rows(q_ptr, q_out_ptr, stride_qt, stride_qh, row, q_heads, cos, sin, d, sign, partner,
               BLOCK_HQ, HEAD_DIM)
    _rope_rows(k_ptr, k_out_ptr, stride_kt, stride_kh, row, k_heads, cos, sin, d, sign, partner,
               BLOCK_HK, HEAD_DIM)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_t, n, BLOCK: tl.constexpr):
    # [T, 2n] gate|up -> [T, n] silu(gate) * up
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    g = tl.load(gu_ptr + row * stride_t + c, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * stride_t + n + c, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * n + c, (s * u).to(g.dtype), mask=ok)


# Kernel launch option: no FMA contraction, so each rounding written above happens.
NO_FMA = {"enable_fp_fusion": False}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonLayerOps(TorchLayerOps):
    """``TorchLayerOps`` with each step one Triton kernel; outputs are new contiguous tensors."""

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                 norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        t, n = x.shape
        if t == 0:
            return super().add_norm(x, delta, norm)
        _rows(x, delta)
        x_out = torch.empty((t, n), dtype=x.dtype, device=x.device) if delta is not None else x
        h_out = torch.empty((t, n), dtype=x.dtype, device=x.device)
        _add_rms_norm_kernel[(t,)](
            x, delta if delta is not None else x, norm.weight, x_out, h_out, x.stride(0),
            delta.stride(0) if delta is not None else 0, n, norm.eps,
            HAS_DELTA=delta is not None, BLOCK=_pow2(n), **NO_FMA)
        return x_out, h_out

    def rope(self, rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, heads, d = q.shape
        if t == 0 or d % 2:
            return super().rope(rope, q, k, positions)
        _rows(q, k, rope.cos, rope.sin)
        q_out = torch.empty((t, heads, d), dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        _rope_kernel[(t,)](
            q, k, q_out, k_out, rope.cos, rope.sin, positions, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), rope.cos.stride(0), heads, k.shape[1],
            HEAD_DIM=d, BLOCK_D=_pow2(d), BLOCK_HQ=_pow2(heads), BLOCK_HK=_pow2(k.shape[1]),
            **NO_FMA)
        return q_out, k_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        t, two_n = gate_up.shape
        n = two_n // 2
        if t == 0:
            return super().silu_mul(gate_up)
        _rows(gate_up)
        out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, _pow2(n))
        _silu_mul_kernel[(t, -(-n // block))](gate_up, out, gate_up.stride(0), n, BLOCK=block,
                                               **NO_FMA)
        return out


def _rows(*tensors: torch.Tensor | None) -> None:
    for x in tensors:
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {x.stride()}")
