"""What every section of the device check shares: the device, the sizes, the floors measured."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Sizes:
    """How big each section's work is: real on a GPU, tiny in a dry run."""

    parity_preset: str  # default_model preset checked against transformers
    parity_prompts: tuple[int, ...]  # prompt lengths
    parity_new_tokens: int
    speed_layers: int  # the speed model (Llama shapes, random weights)
    speed_hidden: int
    speed_intermediate: int
    speed_heads: int
    speed_kv_heads: int
    speed_vocab: int
    decode_batches: tuple[int, ...]  # decode step timings at these batch sizes
    decode_context: int  # prompt tokens of each decoding sequence
    prefill_tokens: int  # one long prompt, one step
    timed_steps: int  # timed repetitions (medians)
    agree_tokens: int  # greedy tokens compared, CUDA graphs against eager
    copy_bytes: int  # device-to-device copy measuring the HBM floor
    matmul_n: int  # n x n x n bf16 matmul measuring the FLOPs peak


GPU_SIZES = Sizes(
    parity_preset="small", parity_prompts=(5, 33, 100), parity_new_tokens=16,
    speed_layers=16, speed_hidden=2048, speed_intermediate=8192, speed_heads=32, speed_kv_heads=8,
    speed_vocab=32000, decode_batches=(1, 64), decode_context=512, prefill_tokens=8192,
    timed_steps=30, agree_tokens=16, copy_bytes=2 * 2 ** 30, matmul_n=8192)

DRY_SIZES = Sizes(
    parity_preset="tiny", parity_prompts=(5, 20), parity_new_tokens=3,
    speed_layers=2, speed_hidden=64, speed_intermediate=128, speed_heads=4, speed_kv_heads=2,
    speed_vocab=1024, decode_batches=(1, 3), decode_context=12, prefill_tokens=32,
    timed_steps=1, agree_tokens=3, copy_bytes=2 ** 20, matmul_n=64)


@dataclass
class CheckContext:
    dry_run: bool
    device: torch.device
    workdir: Path
    sizes: Sizes
    hbm_bytes_per_s: float | None = None  # measured by the floor section
    peak_flops: float | None = None  # bf16, measured by the floor section
    cache: dict[str, object] = field(default_factory=dict)  # checkpoints written once

    @property
    def attention(self) -> str:
        """The engine's attention backend here: Triton (interpreted in a dry run)."""
        return "triton"

    @property
    def half_dtype(self) -> str:
        """The 16-bit dtype checked: bfloat16; float16 in a dry run (Triton's interpreter
        computes bfloat16 dots wrong)."""
        return "float16" if self.dry_run else "bfloat16"

    @property
    def speed_dtype(self) -> str:
        return "float32" if self.dry_run else "bfloat16"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median_s(self, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
        """Median wall time of ``fn`` (synchronized around each call), seconds."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
