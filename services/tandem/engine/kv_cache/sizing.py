"""How many KV blocks an engine gets: fixed, by size, or from the device's free memory.

On CUDA (no ``num_blocks``, no ``memory_gb``) the cache is sized after the
weights are loaded: this engine may hold ``gpu_memory_utilization`` of the
device in all; what the process already holds (the weights) and the working
memory of the largest step (``working_memory_bytes``, an estimate) come off
that, and the rest, never more than is free on the device, goes to KV blocks.
"""

from __future__ import annotations

import torch

from tandem.common.config import CPU_KV_CACHE_GB, CacheConfig
from tandem.engine.model.config import ModelConfig

GIB = 2 ** 30
# cuBLAS and Triton workspaces, the CUDA graph pool's slack, allocator fragmentation.
FIXED_HEADROOM_BYTES = 512 * 2 ** 20


def working_memory_bytes(mc: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                         dtype: torch.dtype) -> int:
    """Peak memory of one step beyond weights and KV cache, estimated from the shapes.

    Per token one layer holds the residual stream and its norm (and float32 copies
    of them), q|k|v, the attention output and the MLP's gate|up and activation;
    the rows that sample hold float32 logits about three times over (logits,
    probabilities, the sampler's work).
    """
    item = torch.empty((), dtype=dtype).element_size()
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_token = (4 * mc.hidden_size + q + 2 * kv + q + 3 * mc.intermediate_size) * item \
        + 2 * mc.hidden_size * 4
    sample_rows = min(max_num_batched_tokens, 4 * max_num_seqs)
    return max_num_batched_tokens * per_token + sample_rows * mc.vocab_size * 4 * 3 \
        + FIXED_HEADROOM_BYTES


def kv_bytes_from_memory(total: int, free: int, held: int, utilization: float,
                         working: int) -> int:
    """KV cache bytes on a device of ``total`` bytes with ``free`` free, of which this
    process ``held`` (the weights) already: ``utilization * total - held - working``,
    capped at ``free - working``; may be <= 0 (nothing left)."""
    return min(int(total * utilization) - held - working, free - working)


def num_kv_blocks(cache: CacheConfig, bytes_per_block: int, device: torch.device,
                  working: int) -> int:
    """Blocks of ``bytes_per_block`` for this engine's cache (at least 2).

    Raises ``ValueError`` when, on CUDA, the weights and working memory leave less
    than two blocks under ``gpu_memory_utilization``.
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.memory_gb is not None:
        return max(2, int(cache.memory_gb * GIB) // bytes_per_block)
    if device.type != "cuda":
        return max(2, int(CPU_KV_CACHE_GB * GIB) // bytes_per_block)
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    kv = kv_bytes_from_memory(total, free, held, cache.gpu_memory_utilization, working)
    if kv < 2 * bytes_per_block:
        raise ValueError(
            f"no room for a KV cache on {device}: the device has {total / GIB:.1f} GiB "
            f"({free / GIB:.1f} free), this engine holds {held / GIB:.1f} GiB and needs "
            f"about {working / GIB:.1f} GiB to run a step; at gpu_memory_utilization "
            f"{cache.gpu_memory_utilization} that leaves {max(kv, 0) / GIB:.2f} GiB. Raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens, or set --kv-cache-gb")
    return kv // bytes_per_block
