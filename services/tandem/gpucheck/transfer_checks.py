"""KV transfer sections: a prefill end and a decode end in two processes, no Ray.

``tandem.transfer.pair_check.check_pair`` moves a paged KV cache between two
spawned processes and checks every block byte for byte, timing each transfer
with device events. On one GPU both ends share it (CUDA IPC, interprocess
events); with two GPUs they talk over a real NCCL communicator. The dry run
moves the cache over the IPC transport's CPU plumbing.
"""

from __future__ import annotations

import torch

from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status


def _pair(ctx: CheckContext, section: str, kind: str, devices: tuple[str, str]) -> list[Result]:
    from tandem.transfer.pair_check import check_pair

    dtype = "float32" if ctx.dry_run else "bfloat16"
    res = check_pair(kind, devices, num_blocks=8 if ctx.dry_run else 256,
                     repeats=2 if ctx.dry_run else 6, dtype=dtype,
                     timeout_s=60.0 if ctx.dry_run else 120.0)
    if res.error is not None:
        return [Result(section, Status.FAIL, res.error[:200])]
    if not res.intact:
        return [Result(section, Status.FAIL, f"{res.kind}: blocks arrived corrupted")]
    ok = Status.DRY if ctx.dry_run else Status.PASS
    return [Result(section, ok, f"{res.kind}: {len(res.seconds)} transfers intact",
                   f"{res.gbps:.2f} GB/s ({res.num_bytes / 2**20:.0f} MiB each)")]


def check_same_device(ctx: CheckContext) -> list[Result]:
    """Both ends on one device: the same-device (CUDA IPC) transport."""
    dev = "cpu" if ctx.dry_run else str(ctx.device)
    return _pair(ctx, "kv transfer: one device", "ipc" if ctx.dry_run else "auto", (dev, dev))


def check_two_devices(ctx: CheckContext) -> list[Result]:
    """Ends on two GPUs: NCCL between two processes (skipped with one GPU)."""
    section = "kv transfer: two devices"
    if ctx.dry_run or torch.cuda.device_count() < 2:
        return [Result(section, Status.SKIP, "needs two GPUs (NCCL between two processes)")]
    return _pair(ctx, section, "auto", ("cuda:0", "cuda:1"))


def transfer_sections():
    return [("kv transfer", check_same_device), ("kv transfer nccl", check_two_devices)]
