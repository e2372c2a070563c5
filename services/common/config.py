"""Configuration dataclasses for the engine and the cluster (standard library only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineRole(str, enum.Enum):
    """Which phases an engine runs."""

    BOTH = "both"  # prefill and decode in one engine (offline, colocated)
    PREFILL = "prefill"  # prefill only: sample token #1, hold KV for export
    DECODE = "decode"  # decode only: sequences arrive with imported KV


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    ``num_blocks`` of ``None`` sizes the pool from ``memory_gb``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_gb: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget; with chunked
    prefill a long prompt is split across steps to fit it.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    role: EngineRole = EngineRole.BOTH

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs: which checkpoint, where, and how to batch it."""

    model: str | None = None  # local HF folder; None = the embedded default
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None = leave as is
    max_model_len: int | None = None  # cap on prompt + output; None = the model's
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
