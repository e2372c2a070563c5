"""The Triton paged-attention kernel against a float64 reference on one mixed batch."""

from __future__ import annotations

import torch

from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status

# (queries, context) per sequence: decodes, a prefill, chunked prefills, a padding sequence
MIXED_BATCH = ((1, 9), (1, 1), (6, 6), (3, 21), (19, 40), (1, 0), (70, 300))


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        table: torch.Tensor, starts: torch.Tensor, ctx: torch.Tensor,
                        scale: float, window: int | None) -> torch.Tensor:
    """Per-sequence float64 causal attention over gathered blocks; ``[T, H, D]`` like ``q``."""
    out = torch.zeros_like(q)
    heads, kv_heads, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    for b in range(len(ctx)):
        first, last, c = int(starts[b]), int(starts[b + 1]), int(ctx[b])
        if c == 0:
            continue
        nb = -(-c // bs)
        rep = heads // kv_heads
        k = k_cache[table[b, :nb]].flatten(0, 1)[:c].double().repeat_interleave(rep, 1)
        v = v_cache[table[b, :nb]].flatten(0, 1)[:c].double().repeat_interleave(rep, 1)
        s = torch.einsum("thd,khd->htk", q[first:last].double(), k) * scale
        pos = torch.arange(c - (last - first), c, device=q.device)[:, None]
        keys = torch.arange(c, device=q.device)[None]
        allowed = keys <= pos
        if window is not None:
            allowed &= keys > pos - window
        s = s.masked_fill(~allowed, float("-inf"))
        out[first:last] = torch.einsum("htk,khd->thd", s.softmax(-1), v).to(q.dtype)
    return out


def random_batch(lens, block_size: int, num_blocks: int, device: torch.device, seed: int = 0):
    """Block table ``[B, W]``, query starts ``[B + 1]``, context lengths ``[B]`` (int64) for
    ``(queries, context)`` pairs, each sequence's blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(-(-c // block_size) for _, c in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for b, (_, c) in enumerate(lens):
        nb = -(-c // block_size)
        table[b, :nb] = perm[used:used + nb]
        used += nb
    starts = torch.tensor([0] + [n for n, _ in lens]).cumsum(0)
    ctx = torch.tensor([c for _, c in lens])
    return table.to(device), starts.to(device), ctx.to(device)


def check_kernel(ctx: CheckContext) -> list[Result]:
    from tandem.engine.kernels import triton_kernels

    lens = MIXED_BATCH if not ctx.dry_run else MIXED_BATCH[:-1]
    results = []
    # bf16: the output is rounded to bf16 (|out| up to ~3) and, as in flash attention, so are
    # the softmax weights before the PV product
    cases = [("float32", 8, 2, 128, 16, None, 2e-5), ("bfloat16", 32, 8, 128, 16, None, 5e-2),
             ("bfloat16", 16, 2, 64, 16, 37, 5e-2)]
    if ctx.dry_run:  # the interpreter is slow, and has no bfloat16 dot
        cases = [("float32", 4, 2, 16, 8, None, 2e-5), ("float32", 8, 1, 32, 16, 5, 2e-5)]
    for dtype_name, heads, kv_heads, head_dim, block_size, window, tol in cases:
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        num_blocks = 64
        table, starts, clen = random_batch(lens, block_size, num_blocks, ctx.device)
        kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=ctx.device).to(dtype)
        vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=ctx.device).to(dtype)
        t = int(starts[-1])
        q = torch.randn(t, heads, head_dim, device=ctx.device).to(dtype)
        out = torch.full_like(q, float("nan"))
        triton_kernels.paged_attention(q, out, kc, vc, table, starts, clen,
                                       max(n for n, _ in lens), head_dim ** -0.5, window)
        ref = reference_attention(q, kc, vc, table, starts, clen, head_dim ** -0.5, window)
        err = float((out.float() - ref.float()).abs().max())
        name = f"kernel {dtype_name} H{heads}/KV{kv_heads} D{head_dim}" + (
            f" window {window}" if window else "")
        ok = err <= tol and not bool(out.isnan().any())
        results.append(Result(name, Status.PASS if ok else Status.FAIL,
                              "matches the float64 reference" if ok else "differs from the reference",
                              f"max err {err:.2e}", f"<= {tol:g}"))
    return results


def check_layer_ops(ctx: CheckContext) -> list[Result]:
    """The fused Triton layer ops against the torch ops they replace, on one batch."""
    from tandem.engine.model.layer_ops import TorchLayerOps
    from tandem.engine.model.llama import RMSNorm
    from tandem.engine.model.rope import RotaryEmbedding
    from tandem.engine.model.triton_layer_ops import TritonLayerOps

    dtype = getattr(torch, ctx.half_dtype)
    dev, t, heads, kv_heads, d, hidden, inter = ctx.device, 37, 32, 8, 128, 4096, 14336
    if ctx.dry_run:
        t, heads, kv_heads, d, hidden, inter = 5, 4, 2, 32, 96, 80
    torch.manual_seed(0)
    ref, fused = TorchLayerOps(), TritonLayerOps()
    norm = RMSNorm(hidden, 1e-6).to(device=dev, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(t, hidden, device=dev).to(dtype)
        delta = torch.randn(t, hidden, device=dev).to(dtype)
        rope = RotaryEmbedding(d, 4096, 500000.0, None, dtype).to(dev)
        qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=dev).to(dtype)
        q = qkv[:, :heads * d].view(t, heads, d)
        k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
        positions = torch.randint(0, 4096, (t,), device=dev)
        gate_up = torch.randn(t, 2 * inter, device=dev).to(dtype)
        pairs = [(ref.add_norm(x, delta, norm), fused.add_norm(x, delta, norm)),
                 (ref.rope(rope, q, k, positions), fused.rope(rope, q, k, positions)),
                 ((ref.silu_mul(gate_up),), (fused.silu_mul(gate_up),))]
    worst = 0.0  # in units of the dtype's relative rounding step
    eps = torch.finfo(dtype).eps
    for want, got in pairs:
        for a, b in zip(want, got):
            rel = ((a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-3)).max()
            worst = max(worst, float(rel) / eps)
    ok = worst <= 1.0
    return [Result(f"fused layer ops {ctx.half_dtype}", Status.PASS if ok else Status.FAIL,
                   "add+RMSNorm, RoPE, SiLU-mul equal to the torch ops" if ok
                   else "fused ops differ from the torch ops",
                   f"max {worst:.2f} ulp", "<= 1 ulp")]
