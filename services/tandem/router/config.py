"""Router configuration (frozen, validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.common.config import (LOCAL_PREFILL_THRESHOLD, MAX_QUEUED_REQUESTS,
                                   PREFILL_SATURATION_S, ClusterMode)

DISAGGREGATED = ClusterMode.DISAGGREGATED.value
COLOCATED = ClusterMode.COLOCATED.value
CONDITIONAL = ClusterMode.CONDITIONAL.value
MODES = tuple(m.value for m in ClusterMode)


@dataclass(frozen=True)
class RouterConfig:
    """How the router places requests.

    - ``mode``: ``"disaggregated"`` (prefill on the prefill pool), ``"colocated"``
      (one pool of ``both`` workers, no prefill worker) or ``"conditional"``
      (disaggregated, but the decode worker prefills locally when the prompt is
      shorter than ``local_prefill_threshold`` tokens or every prefill worker is
      saturated: its queued prompt tokens would take more than
      ``prefill_saturation_s`` at the rate its recent steps computed them, or,
      before it measured a rate, exceed ``prefill_saturation_tokens``).
    - ``max_queued_requests``: admission bound on each worker's waiting queue
      (reported waiting + requests the router sent that the worker has not
      reported yet); a worker at the bound takes no new request.
    - ``block_size``: tokens per block for prefix-affinity hashes (the engines'
      KV block size). Block counts for capacity use each worker's own
      ``WorkerLoad.block_size``.
    - ``prefix_weight``: tokens of credit per prefix-cached prompt token when
      ranking prefill workers (1.0: a cached token is a token not recomputed).
    - ``prefix_cache_blocks``: bound on the block hashes remembered per worker (LRU).
    - ``local_prefill_fallback``: in disaggregated mode, prefill on the decode
      worker when no prefill worker is alive (otherwise ``NoWorkersError``).
    - ``free_weight`` / ``load_weight``: decode score = free_weight * free
      blocks / largest pool + ... - load_weight * (running + waiting) / max_num_seqs.
    - ``retry_after_s``: the hint carried by ``ClusterFullError``.
    """

    mode: str = DISAGGREGATED
    local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD
    prefill_saturation_s: float = PREFILL_SATURATION_S
    prefill_saturation_tokens: int = 16384
    max_queued_requests: int = MAX_QUEUED_REQUESTS
    block_size: int = 16
    prefix_weight: float = 1.0
    prefix_cache_blocks: int = 16384
    local_prefill_fallback: bool = True
    free_weight: float = 1.0
    load_weight: float = 1.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        mode = str(getattr(self.mode, "value", self.mode))
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "mode", mode)
        for name in ("local_prefill_threshold", "prefill_saturation_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_queued_requests", "block_size", "prefix_cache_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_saturation_s", "prefix_weight", "free_weight", "load_weight",
                     "retry_after_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
