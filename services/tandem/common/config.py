"""Configuration dataclasses for the engine and the cluster (standard library only).

Each setting has its one default here. Field metadata carries what the command line and
``LLM(...)`` need to expose it (see ``tandem.common.config_fields``): ``help``,
``flag`` (a CLI name other than ``--field-name``), ``keyword`` (an ``LLM`` keyword other
than the field name), ``cli=False`` / ``keyword=None`` to keep it off either.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field


class EngineRole(str, enum.Enum):
    """Which phases an engine runs."""

    BOTH = "both"  # prefill and decode in one engine (offline, colocated)
    PREFILL = "prefill"  # prefill only: sample token #1, hold KV for export
    DECODE = "decode"  # decode only: sequences arrive with imported KV


class ClusterMode(enum.StrEnum):
    """How a cluster splits the two phases between its pools."""

    DISAGGREGATED = "disaggregated"  # prefill pool + decode pool, KV streamed between them
    COLOCATED = "colocated"  # one pool of engines that do both
    CONDITIONAL = "conditional"  # disaggregated, short prompts prefilled on the decode worker


class TransferBackend(enum.StrEnum):
    """KV transfer transport: nccl on GPUs, gloo on CPU, auto picks by device."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


# Engine dtypes: auto = the checkpoint's on GPU, float32 on CPU; the rest with their aliases.
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")
CPU_FP32_DTYPES = ("auto", "float32", "fp32")  # the dtypes that keep fp32 weights on CPU
QUANTIZATIONS = ("int8",)  # weight-only, per output channel (CPU)
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: str) -> str:
    """``device`` if it is ``cpu``, ``cuda`` or ``cuda:N``; ValueError otherwise."""
    if not _DEVICE.match(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def _enum(cls: type[enum.Enum], value: object, name: str) -> enum.Enum:
    try:
        return cls(getattr(value, "value", value))
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


# KV cache per engine on CPU when neither num_blocks nor memory_gb is given, GiB.
CPU_KV_CACHE_GB = 1.0
# Attention backends: auto = Triton kernels on CUDA, torch (SDPA, native CPU kernels) elsewhere.
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CPU_WEIGHT_LAYOUTS = ("packed", "blocked", "plain")  # see services/tandem/engine/kernels/onednn.py

# Defaults the router shares (tandem.router.config.RouterConfig takes them from here).
LOCAL_PREFILL_THRESHOLD = 64
# conditional mode: a prompt that would wait longer than this for a prefill worker's turn,
# seconds, prefills on the decode worker instead
PREFILL_SATURATION_S = 1.0
MAX_QUEUED_REQUESTS = 256


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing (``tandem.engine.kv_cache.sizing`` applies it).

    ``num_blocks`` wins when set; else ``memory_gb`` when set; else, on CUDA, what
    ``gpu_memory_utilization`` of the device leaves after the weights and the
    step's working memory, and on CPU ``CPU_KV_CACHE_GB``.
    """

    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV cache blocks per engine (default: sized by --kv-cache-gb or "
                "--gpu-memory-utilization)"})
    memory_gb: float | None = field(default=None, metadata={
        "flag": "--kv-cache-gb", "keyword": "kv_cache_memory_gb",
        "help": f"KV cache per engine, GiB (default: {CPU_KV_CACHE_GB:g} on CPU; on CUDA what "
                "--gpu-memory-utilization leaves)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "CUDA: fraction of the device's memory this engine may use in all (weights, "
                "working memory, KV cache); the KV cache gets the rest"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of prompt prefixes seen before"})

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget; with chunked
    prefill a long prompt is split across steps to fit it.
    """

    max_num_seqs: int = field(default=256, metadata={"help": "sequences batched per step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget per step"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prompts across steps to fit the token budget"})
    role: EngineRole = field(default=EngineRole.BOTH, metadata={"cli": False, "keyword": None})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        object.__setattr__(self, "role", _enum(EngineRole, self.role, "role"))


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

    method: str | None = field(default=None, metadata={
        "flag": "--speculative", "keyword": "speculative", "choices": ("ngram", "draft"),
        "help": "speculative decoding in the decode pool (ngram: prompt lookup; draft: "
                "--speculative-draft-model drafts)"})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "most draft tokens verified per step"})
    ngram_min: int = field(default=2, metadata={
        "flag": "--speculative-ngram-min", "keyword": "speculative_ngram_min",
        "help": "shortest n-gram prompt lookup matches"})
    ngram_max: int = field(default=4, metadata={
        "flag": "--speculative-ngram-max", "keyword": "speculative_ngram_max",
        "help": "longest n-gram prompt lookup matches"})
    adaptive: bool = field(default=True, metadata={
        "flag": "--speculative-adaptive", "keyword": "speculative_adaptive",
        "help": "draft length per sequence from its acceptance rate"})
    # From `tandem bench spec` (bench preset, CPU): verifying drafts lengthens a decode
    # step by about this much per position at small batches and by more at larger ones,
    # where speculation pays only at a high acceptance rate (hence max_batch_size).
    verify_cost: float = field(default=0.15, metadata={
        "flag": "--speculative-verify-cost", "keyword": "speculative_verify_cost",
        "help": "cost of one verified position relative to a decode step"})
    max_batch_size: int = field(default=8, metadata={
        "flag": "--speculative-max-batch-size", "keyword": "speculative_max_batch_size",
        "help": "no drafting in steps with more decoding sequences than this"})
    draft_model: str | None = field(default=None, metadata={
        "flag": "--speculative-draft-model", "keyword": "draft_model",
        "help": "local model folder of a small model with the target's vocabulary (method draft)"})
    # The draft's KV of a sequence's prompt is computed on the engine that decodes it
    # (in disaggregated mode the decode worker), in chunks of at most this many tokens
    # per step, so a long prompt arriving does not stall the running streams' steps.
    draft_prefill_chunk: int = field(default=64, metadata={
        "flag": "--speculative-draft-prefill-chunk", "keyword": "speculative_draft_prefill_chunk",
        "help": "most prompt tokens the draft model catches up on per step (method draft)"})

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
        if self.draft_prefill_chunk < 1:
            raise ValueError(f"draft_prefill_chunk must be >= 1, got {self.draft_prefill_chunk}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs: which checkpoint, where, and how to batch it."""

    # a model folder, a .gguf file or a hub repo id; None = the embedded default
    model: str | None = field(default=None, metadata={"cli": False, "keyword": None})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPES, "help": "weights and KV dtype (auto: the checkpoint's on GPU, float32 on "
                                   "CPU; bfloat16 on CPU is fast with AVX-512 BF16 or AMX only)"})
    quantization: str | None = field(default=None, metadata={
        "choices": QUANTIZATIONS, "help": "CPU: int8 weights, one scale per output channel "
                                          "(activations and KV in --dtype)"})
    device: str = field(default="cpu", metadata={"type": check_device, "help": "cpu | cuda | cuda:N"})
    num_threads: int | None = field(default=None, metadata={
        "flag": "--threads", "help": "torch intra-op threads (default: torch's)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "cap on prompt + output tokens (default: the model's context)"})
    seed: int = field(default=0, metadata={"help": "sampler seed"})
    onednn: bool = field(default=True, metadata={
        "help": "CPU fp32: oneDNN matmuls (faster; rounding differs from MKL's)"})
    cpu_weight_layout: str = field(default="packed", metadata={
        "choices": CPU_WEIGHT_LAYOUTS,
        "help": "CPU weights (the offline engine, colocated workers, the decode pool by "
                "default, and the prefill pool's with bf16 weights): packed (fp32 on AVX-512 or AVX2: one native kernel for every step, decode "
                "steps through all layers in one native call; bf16 on AMX-BF16: a native kernel on "
                "the AMX tiles for every step, on AVX-512 BF16 without AMX one on AVX-512; else "
                "blocked), blocked "
                "(oneDNN's layout) or plain (oneDNN, and the native GEMV for decode steps of up "
                "to 16 rows in fp32, 2 in bf16)"})
    cpu_kernels: bool = field(default=True, metadata={
        "help": "CPU: native decode attention, fused kernels and the decode-row GEMV "
                "(compiled on first use)"})
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS,
        "help": "paged attention: triton (CUDA kernels reading the blocks in place), torch "
                "(SDPA over gathered blocks); auto: triton on CUDA, torch elsewhere"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "CUDA: replay decode steps as CUDA graphs captured per batch-size bucket"})
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unsupported quantization {self.quantization!r}; "
                             f"choose one of {', '.join(QUANTIZATIONS)}")
        check_device(self.device)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.cpu_weight_layout not in CPU_WEIGHT_LAYOUTS:
            raise ValueError(f"cpu_weight_layout must be one of {', '.join(CPU_WEIGHT_LAYOUTS)}, "
                             f"got {self.cpu_weight_layout!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


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

    mode: ClusterMode = field(default=ClusterMode.DISAGGREGATED, metadata={
        "help": "disaggregated: prefill and decode pools; colocated: one pool doing both; "
                "conditional: disaggregated, short prompts prefilled on the decode worker"})
    prefill_workers: int = field(default=1, metadata={"help": "workers in the prefill pool"})
    decode_workers: int = field(default=1, metadata={"help": "workers in the decode pool"})
    engine: EngineConfig = EngineConfig()
    # None: sized to the host (tandem.cluster.cpu_sizing), or on a joined Ray cluster by
    # each worker on its node (tandem.worker.threads.node_threads).
    threads_per_worker: int | None = field(default=None, metadata={
        "help": "torch threads per worker (default: on a CPU cluster started here, the usable "
                "cores shared equally among the workers; on a Ray cluster joined, each worker's "
                "node's CPUs shared among the workers its pool's resource admits there; CUDA: 1)"})
    # CPU hosts the pools share: a decode worker takes more threads while no prefill is
    # pending for it (the prefill workers' cores are idle then), threads_per_worker otherwise.
    decode_burst_threads: int | None = field(default=None, metadata={
        "help": "disaggregated on CPU: decode workers run this many torch threads while no "
                "prefill is pending for them, threads-per-worker otherwise (0: off; default: on "
                "a CPU cluster started here, the usable cores shared among the decode workers; "
                "else off)"})
    # The same for prefill workers: more threads while the decode workers hold no request
    # but those being prefilled (nothing decodes: their cores are idle), e.g. a lone prompt.
    prefill_burst_threads: int | None = field(default=None, metadata={
        "help": "disaggregated on CPU: prefill workers run this many torch threads while the "
                "decode workers hold no request but the ones it is prefilling, threads-per-worker "
                "otherwise (0: off; default: on a CPU cluster started here, the usable cores "
                "shared among the prefill workers; else off, as it needs the pools on one host)"})
    # Each pool's steps are one phase: fp32 prompts run fastest on oneDNN's blocked layout,
    # decode steps on the packed one (--cpu-weight-layout's default). bf16 prompts run as
    # fast packed for AMX (faster for the AVX-512 bf16 kernels than on oneDNN), and there
    # the two pools compute alike (pool_layout).
    prefill_weight_layout: str | None = field(default=None, metadata={
        "choices": CPU_WEIGHT_LAYOUTS,
        "help": "CPU, disaggregated or conditional: the prefill pool's weight layout (default: "
                "blocked with fp32 weights, the faster for prompts there; --cpu-weight-layout "
                "otherwise: in bf16, packed is as fast on AMX and faster on AVX-512 BF16, and prompts prefilled on "
                "either pool then give the same tokens)"})
    decode_weight_layout: str | None = field(default=None, metadata={
        "choices": CPU_WEIGHT_LAYOUTS,
        "help": "CPU, disaggregated or conditional: the decode pool's weight layout (default: "
                "--cpu-weight-layout)"})
    cpus_per_worker: float = field(default=0.0, metadata={"help": "Ray CPUs each worker asks for"})
    # None: 1 on CUDA (one GPU per worker: NCCL ranks never share one), 0 on CPU.
    gpus_per_worker: float | None = field(default=None, metadata={
        "help": "Ray GPUs each worker asks for (default: 1 with --device cuda, 0 on CPU); "
                "under 1, workers share GPUs and pairs on one GPU use CUDA IPC"})
    prefill_accelerator_type: str | None = field(default=None, metadata={
        "help": "Ray accelerator type the prefill workers ask for"})
    decode_accelerator_type: str | None = field(default=None, metadata={
        "help": "Ray accelerator type the decode workers ask for"})
    prefill_resources: tuple[tuple[str, float], ...] = field(default=(), metadata={
        "flag": "--prefill-resource", "help": "custom Ray resource each prefill worker asks for "
        "(NAME=AMOUNT, repeatable)"})
    decode_resources: tuple[tuple[str, float], ...] = field(default=(), metadata={
        "flag": "--decode-resource", "help": "custom Ray resource each decode worker asks for "
        "(NAME=AMOUNT, repeatable)"})
    transfer_backend: TransferBackend = field(default=TransferBackend.AUTO, metadata={
        "help": "KV transport: nccl on GPUs, gloo on CPU; auto picks by device"})
    layer_group_size: int | None = field(default=2, metadata={"help": "layers per streamed KV group; -1: all layers in one group"})
    checksum: bool = field(default=False, metadata={"help": "checksum every KV payload"})
    rebalance: bool = field(default=True, metadata={
        "help": "move running requests from a decode worker much fuller than another "
                "(needs kv_migration)"})
    kv_migration: bool = field(default=True, metadata={
        "help": "connect the decode workers to each other, so a running request moves to "
                "another with its KV (drain, rebalancing) instead of being prefilled again"})
    transfer_timeout_s: float = field(default=30.0, metadata={"help": "KV transfer timeout, seconds"})
    # KV runs consecutive on both sides go in place (no staging copies) when their mean
    # (layer, K|V) plane is at least this many bytes; None: always gather.
    kv_in_place_min_bytes: int | None = field(default=KV_IN_PLACE_MIN_BYTES, metadata={
        "help": "send KV block runs consecutive on both sides in place (no staging copies) when "
                "a run's layer plane averages at least N bytes; -1: never"})
    local_prefill_threshold: int = field(default=LOCAL_PREFILL_THRESHOLD, metadata={
        "help": "conditional mode: shorter prompts prefill on the decode worker"})
    prefill_saturation_s: float = field(default=PREFILL_SATURATION_S, metadata={
        "help": "conditional mode: prefill on the decode worker when every prefill worker's "
                "queued prompts would take longer than this, seconds, at its measured rate"})
    max_queued_requests: int = field(default=MAX_QUEUED_REQUESTS, metadata={
        "help": "admission bound per worker; beyond it requests get 429"})
    max_attempts: int = field(default=3, metadata={"help": "tries per request across worker failures"})
    ray_address: str | None = field(default=None, metadata={
        "help": "join this Ray cluster (default: start one)"})
    # CPU hosts the pools share: prefill workers run at this niceness (0-19), so the
    # decode steps that set TPOT get the CPU first and prefill takes what is left.
    prefill_nice: int = field(default=0, metadata={
        "help": "CPU hosts the pools share: run prefill workers at this niceness (0-19) so "
                "decode steps get the CPU first (0: off)"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _enum(ClusterMode, self.mode, "mode"))
        object.__setattr__(self, "transfer_backend",
                           _enum(TransferBackend, self.transfer_backend, "transfer_backend"))
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers must be >= 1, got {self.decode_workers}")
        if self.kv_in_place_min_bytes is not None and self.kv_in_place_min_bytes < 0:
            raise ValueError(f"kv_in_place_min_bytes must be >= 0 or None, "
                             f"got {self.kv_in_place_min_bytes}")
        if not (math.isfinite(self.prefill_saturation_s) and self.prefill_saturation_s >= 0):
            raise ValueError(f"prefill_saturation_s must be a finite number >= 0, "
                             f"got {self.prefill_saturation_s!r}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be in [0, 19], got {self.prefill_nice}")
        if self.prefill_workers < (0 if self.mode == "colocated" else 1):
            raise ValueError(f"prefill_workers must be >= 1 in {self.mode} mode")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        for name in ("decode_burst_threads", "prefill_burst_threads"):
            if (value := getattr(self, name)) is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.prefill_burst_threads and self.ray_address is not None:
            raise ValueError("prefill_burst_threads needs the pools on one host: a cluster "
                             "started here, not one joined with ray_address")
        for name in ("prefill_weight_layout", "decode_weight_layout"):
            if getattr(self, name) not in (None, *CPU_WEIGHT_LAYOUTS):
                raise ValueError(f"{name} must be one of {', '.join(CPU_WEIGHT_LAYOUTS)}, "
                                 f"got {getattr(self, name)!r}")
        self._check_placement()

    def pool_layout(self, role: str) -> str:
        """The CPU weight layout a worker of ``role`` runs: "prefill" and "decode" are the
        pools of a disaggregated or conditional cluster, "colocated" a worker doing both
        phases (it keeps --cpu-weight-layout)."""
        if role == "prefill":
            if self.prefill_weight_layout is not None:
                return self.prefill_weight_layout
            fp32 = self.engine.dtype in CPU_FP32_DTYPES
            return "blocked" if fp32 else self.engine.cpu_weight_layout
        if role == "decode":
            return self.decode_weight_layout or self.engine.cpu_weight_layout
        if role == "colocated":
            return self.engine.cpu_weight_layout
        raise ValueError(f"role must be prefill, decode or colocated, got {role!r}")

    def _check_placement(self) -> None:
        """One GPU per NCCL rank; transports that fit the device."""
        cuda = self.engine.device.startswith("cuda")
        if self.gpus_per_worker is None:
            object.__setattr__(self, "gpus_per_worker", 1.0 if cuda else 0.0)
        gpus = self.gpus_per_worker
        if gpus < 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {gpus}")
        if gpus and not cuda:
            raise ValueError(f"gpus_per_worker={gpus:g} with device {self.engine.device!r}: "
                             "GPUs are for --device cuda")
        if self.mode == ClusterMode.COLOCATED:
            return  # no KV moves between workers
        backend = self.transfer_backend
        if backend == TransferBackend.NCCL and not cuda:
            raise ValueError("transfer_backend nccl moves GPU memory: it needs --device cuda "
                             "(on CPU use gloo or auto)")
        if backend == TransferBackend.GLOO and cuda:
            raise ValueError("transfer_backend gloo moves host memory, not a CUDA KV cache: "
                             "use nccl or auto with --device cuda")
        if backend == TransferBackend.NCCL and gpus < 1:
            raise ValueError(
                f"transfer_backend nccl with gpus_per_worker={gpus:g}: two NCCL ranks would "
                "share one GPU, which NCCL refuses. Give each worker a GPU "
                "(--gpus-per-worker 1) or use --transfer-backend auto, which sends KV between "
                "workers on the same GPU through CUDA IPC")
