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
class SpeculativeConfig:
    """Speculative decoding in decode-capable engines (off when ``method`` is None).

    ``ngram``: prompt lookup. The last ``ngram_max`` .. ``ngram_min`` tokens are
    looked up earlier in the prompt and output, and the tokens that followed
    are proposed. ``draft``: the checkpoint at ``draft_model`` (same vocabulary,
    smaller) drafts greedily, with its own KV cache on the target's block
    tables. Either way the target model verifies up to ``num_speculative_tokens`` of
    them plus one token of its own in a single forward pass. With ``adaptive``,
    each sequence drafts the k that maximises its expected tokens per unit of
    step cost, from its running acceptance rate and ``verify_cost`` (the cost of
    one more verified position relative to a whole decode step). Nothing is
    drafted in a step with more than ``max_batch_size`` decoding sequences,
    where verification costs more than it saves.
    """

    method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True
    # Measured with `tandem bench spec` (bench preset, CPU): verifying 4 drafts made a
    # decode step 1.5-1.7x as long at batch 1-4 (0.13-0.17 per position), 2.0x at 8
    # and 2.7x at 16, where speculation only pays above ~70% acceptance.
    verify_cost: float = 0.15
    max_batch_size: int = 8
    draft_model: str | None = None  # local HF folder (method "draft")

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram', 'draft' or None, "
                             f"got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft_model is needed with method 'draft', and only then")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.verify_cost < 0:
            raise ValueError(f"verify_cost must be >= 0, got {self.verify_cost}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs: which checkpoint, where, and how to batch it."""

    model: str | None = None  # local HF folder; None = the embedded default
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None = leave as is
    max_model_len: int | None = None  # cap on prompt + output; None = the model's
    seed: int = 0
    onednn: bool = True  # CPU fp32: oneDNN matmuls (faster; rounding differs from MKL's)
    cpu_kernels: bool = True  # CPU fp32: native decode attention (compiled on first use)
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()


# Below this mean plane per run, one gathered KV message beats many small in-place ones.
KV_IN_PLACE_MIN_BYTES = 256 * 1024


@dataclass(frozen=True)
class ClusterConfig:
    """Pools, placement and transfer settings of one tandem cluster.

    On GPU clusters each pool asks Ray for its own GPUs and, optionally, an
    accelerator type or custom resource (e.g. prefill on high-FLOPS GPUs,
    decode on high-bandwidth ones). On CPU, workers take a fraction of a CPU
    and run ``threads_per_worker`` torch threads.
    """

    mode: str = "disaggregated"  # disaggregated | colocated | conditional
    prefill_workers: int = 1
    decode_workers: int = 1
    engine: EngineConfig = EngineConfig()
    threads_per_worker: int = 1
    cpus_per_worker: float = 0.0
    gpus_per_worker: float = 0.0
    prefill_accelerator_type: str | None = None
    decode_accelerator_type: str | None = None
    prefill_resources: tuple[tuple[str, float], ...] = ()
    decode_resources: tuple[tuple[str, float], ...] = ()
    transfer_backend: str = "auto"  # auto | gloo | nccl
    layer_group_size: int | None = 2  # layers per streamed group; None = one group
    checksum: bool = False
    transfer_timeout_s: float = 30.0
    # KV runs consecutive on both sides go in place (no staging copies) when their mean
    # (layer, K|V) plane is at least this many bytes; None: always gather.
    kv_in_place_min_bytes: int | None = KV_IN_PLACE_MIN_BYTES
    local_prefill_threshold: int = 64  # conditional mode: shorter prompts prefill on D
    max_queued_requests: int = 256
    max_attempts: int = 3
    ray_address: str | None = None
    # CPU hosts the pools share: prefill workers run at this niceness (0-19), so the
    # decode steps that set TPOT get the CPU first and prefill takes what is left.
    prefill_nice: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated", "conditional"):
            raise ValueError(f"mode must be disaggregated, colocated or conditional, got {self.mode!r}")
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers must be >= 1, got {self.decode_workers}")
        if self.kv_in_place_min_bytes is not None and self.kv_in_place_min_bytes < 0:
            raise ValueError(f"kv_in_place_min_bytes must be >= 0 or None, "
                             f"got {self.kv_in_place_min_bytes}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be in [0, 19], got {self.prefill_nice}")
        if self.prefill_workers < (0 if self.mode == "colocated" else 1):
            raise ValueError(f"prefill_workers must be >= 1 in {self.mode} mode")
        if self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
