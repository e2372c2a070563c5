"""The elementwise steps of a decoder layer: residual add + RMSNorm, RoPE, SiLU-and-mul.

``TorchLayerOps`` computes them with torch ops, exactly as HF transformers
does. ``NativeLayerOps`` (installed only on a CPU model with fp32 activations) runs each as one
pass of a native CPU kernel (``cpu_kernels.py``, which checks its tensors);
RoPE rounds identically, the norm and SiLU within float32 rounding of torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.model.cpu_kernels import CpuKernels
from services.engine.model.rope import RotaryEmbedding


class TorchLayerOps:
    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                 norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + delta`` (when given) and its RMSNorm; ``x, delta [T, hidden]``."""
        if delta is not None:
            x = x + delta
        return x, norm(x)

    def rope(self, rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``q [T, H, D]`` and ``k [T, KVH, D]`` (possibly in place)."""
        return rope(q, k, positions)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` fused gate|up projection -> ``silu(gate) * up [T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeLayerOps(TorchLayerOps):
    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                 norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.kernels.add_rms_norm(x, delta, norm.weight, norm.eps)  # x updated in place

    def rope(self, rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.rope_(q, k, rope.cos, rope.sin, positions)
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)
