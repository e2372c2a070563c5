"""``tandem bench attention``: the native attention kernels on CPU.

Decode (the default): decode attention reads every sequence's K and V once per layer, so
at batch and context sizes past the caches it is bound by memory: the figure that matters
is the rate at which it reads the cache, against what a streaming ``sum`` reads in the same run. The K/V blocks of
each sequence are scattered over the cache as a long-running server's are (a random block
table), one cache per layer so no layer finds the previous one's blocks in cache.

Prompts (``--prompt N``): each row is a chunk of N query tokens at the end of its
``--context``; prompt attention is bound by compute, so the native kernel is timed
against the torch path it replaces (gather the blocks, masked SDPA), interleaved
A B A B in one process, as medians and GFLOP/s; with a bf16 cache on a CPU with AMX,
also the native AMX kernel the engine runs prompts with there and torch's bf16 SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING

from tandem.bench import runinfo

if TYPE_CHECKING:
    from tandem.engine.kernels.cpu_kernels import CpuKernels


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=32, help="decode rows (sequences) per step")
    p.add_argument("--context", type=int, default=160,
                   help="tokens each row attends (with --prompt: the chunk's last position + 1)")
    p.add_argument("--prompt", type=int, default=0,
                   help="query tokens per row at the end of its context (0: one, decode)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="layers per timed step (distinct caches)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)


def main(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.offline import read_bandwidth_gbs
    from tandem.engine import huge_pages
    from tandem.engine.kernels import cpu_kernels

    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        print("the native CPU kernels did not build on this machine: nothing to measure")
        return 1
    if args.prompt > 0:
        return _prompt(args, kernels)
    dtype = getattr(torch, args.kv_dtype)
    rows, kvh, d, bs = args.rows, args.kv_heads, args.head_dim, args.block_size
    per_row = -(-args.context // bs)
    num_blocks = rows * per_row + 1
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=gen)[:rows * per_row].view(rows, per_row)
    caches = [(huge_pages.copy_of(torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)),
               huge_pages.copy_of(torch.randn(num_blocks, bs, kvh, d, generator=gen).to(dtype)))
              for _ in range(args.layers)]  # on huge pages, as the engine's cache is
    q = torch.randn(rows, args.heads, d, generator=gen)  # [rows, H, D]
    out = torch.empty_like(q)
    token_rows = torch.arange(rows)
    positions = torch.full((rows,), args.context - 1, dtype=torch.long)

    def step() -> float:
        t0 = time.perf_counter()
        for k_cache, v_cache in caches:
            kernels.paged_decode(q, out, token_rows, k_cache, v_cache, table, positions, None, d ** -0.5)
        return time.perf_counter() - t0

    step()
    times = [step() for _ in range(args.repeats)]
    read = read_bandwidth_gbs()
    kv_bytes = 2 * args.layers * rows * args.context * kvh * d * caches[0][0].element_size()
    median = statistics.median(times)
    print(runinfo.machine_line())
    print(f"decode attention, {rows} rows x {args.context} tokens, {args.heads}/{kvh} heads of {d}, "
          f"{args.layers} layers, {args.kv_dtype} KV, {args.threads} threads: "
          f"{1e3 * median:.2f} ms [{1e3 * min(times):.2f}-{1e3 * max(times):.2f}] a step, "
          f"{kv_bytes / 1e6:.0f} MB of K/V at {kv_bytes / median / 1e9:.1f} GB/s "
          f"against {read:.1f} GB/s for a streaming read ({100 * kv_bytes / median / 1e9 / read:.0f}%)")
    return 0


def _prompt(args: argparse.Namespace, kernels: CpuKernels) -> int:
    """Prompt chunks through the attention backend with and without the native kernels."""
    import torch

    from tandem.engine.kernels import cpu_features
    from tandem.engine.model.attention import (AttentionGroup, AttentionMetadata,
                                                 TorchPagedAttention)

    if not kernels.prefill_supported(args.head_dim):
        print(f"no native prompt attention for head size {args.head_dim} on this CPU")
        return 1
    dtype = getattr(torch, args.kv_dtype)
    rows, n, kvh, d, bs = args.rows, args.prompt, args.kv_heads, args.head_dim, args.block_size
    context = max(args.context, n)
    start, per_row = context - n, -(-context // bs)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(rows * per_row + 1, generator=gen)[:rows * per_row].view(rows, per_row)
    k_cache = torch.randn(rows * per_row + 1, bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(dtype)
    q = torch.randn(rows * n, args.heads, d, generator=gen)
    k, v = torch.randn(rows * n, kvh, d, generator=gen), torch.randn(rows * n, kvh, d, generator=gen)
    pos = start + torch.arange(n)
    slots = (table[:, pos // bs] * bs + pos % bs).flatten()
    keys = torch.arange(per_row * bs)
    mask = None if start == 0 else (keys[None, :] <= pos[:, None])[None, None].expand(rows, 1, n, -1)
    group = AttentionGroup(
        token_index=torch.arange(rows * n).view(rows, n), valid_flat=None,
        token_rows=torch.arange(rows * n), block_table=table,
        last_pos=torch.full((rows,), context - 1), mask=mask, first_row=torch.arange(rows) * n,
        first_pos=torch.full((rows,), start), query_len=torch.full((rows,), n), prompt=True)
    meta = AttentionMetadata(slot_mapping=slots, groups=[group])
    sides = {"native": TorchPagedAttention(d ** -0.5, kernels=kernels, amx_prompts=False),
             "torch": TorchPagedAttention(d ** -0.5, amx_prompts=False)}
    if dtype == torch.bfloat16 and cpu_features.has_amx_bf16():
        if kernels.prefill_supported(d, amx=True):
            sides["AMX kernel"] = TorchPagedAttention(d ** -0.5, kernels=kernels, amx_prompts=True)
        sides["bf16 SDPA (AMX)"] = TorchPagedAttention(d ** -0.5, amx_prompts=True)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.repeats + 1):
        for name, attend in sides.items():
            t0 = time.perf_counter()
            for _ in range(args.layers):
                attend(q, k, v, k_cache, v_cache, meta)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    flops = 4 * args.heads * d * rows * (n * start + n * n / 2) * args.layers
    medians = {name: statistics.median(times[name]) for name in sides}
    plain = medians["torch"]
    print(runinfo.machine_line())
    print(f"prompt attention, {rows} rows x {n} tokens at {start}..{context - 1}, "
          f"{args.heads}/{kvh} heads of {d}, {args.layers} layers, {args.kv_dtype} KV, "
          f"{args.threads} threads, medians of {args.repeats} interleaved:")
    print(f"  gather + SDPA {1e3 * plain:.2f} ms ({flops / plain / 1e9:.0f} GFLOP/s)")
    for name, t in medians.items():
        if name != "torch":
            print(f"  {name} {1e3 * t:.2f} ms ({flops / t / 1e9:.0f} GFLOP/s): {plain / t:.2f}x")
    return 0
