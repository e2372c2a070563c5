"""The CUDA attention backend: Triton kernels reading the paged cache in place.

Why Triton rather than FlexAttention with a block mask: a paged cache needs
its block table applied inside the kernel, and FlexAttention's paged support
rebuilds a block mask (host work) whenever a sequence crosses a block, which
is every step of a decode batch; it also compiles per shape. One Triton
kernel takes the block table and per-sequence lengths as device tensors, so
a decode step launches the same kernel with the same grid whatever the
context lengths are, which is what CUDA graph replay needs.

``select_attention`` picks the backend: ``auto`` is Triton on CUDA (when
triton is importable) and torch elsewhere; ``triton`` on CPU needs Triton's
interpreter (``TRITON_INTERPRET=1``), which the unit tests use.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from tandem.common.config import ATTENTION_BACKENDS
from tandem.engine.model.attention import AttentionBackend, AttentionMetadata


class TritonPagedAttention:
    """KV written by one kernel at ``meta.slot_mapping``, then one varlen attention kernel."""

    uses_varlen = True

    def __init__(self, scale: float, sliding_window: int | None = None) -> None:
        from tandem.engine.kernels import triton_kernels

        self.scale = scale
        self.sliding_window = sliding_window
        self._kernels = triton_kernels

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        batch = meta.varlen
        if batch is None:
            raise ValueError("TritonPagedAttention needs varlen metadata (meta.varlen)")
        self._kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)  # [T, H, D] contiguous
        self._kernels.paged_attention(q, out, k_cache, v_cache, batch.block_table,
                                      batch.query_start, batch.context_len, batch.max_query_len,
                                      self.scale, self.sliding_window)
        return out


def triton_usable(device: torch.device) -> str | None:
    """None if the Triton backend can run on ``device``; else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return f"the triton backend needs CUDA (or TRITON_INTERPRET=1 on {device.type})"


def select_attention(name: str, device: torch.device, current: AttentionBackend,
                     scale: float, sliding_window: int | None) -> AttentionBackend:
    """The backend ``name`` asks for on ``device``; ``current`` where that is the torch one.

    Raises ``ValueError`` for an unknown name, or ``triton`` where it cannot run.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {name!r}")
    why_not = triton_usable(device)
    if name == "triton" and why_not is not None:
        raise ValueError(why_not)
    if name == "triton" or (name == "auto" and device.type == "cuda" and why_not is None):
        return TritonPagedAttention(scale, sliding_window)
    return current
