"""The elementwise steps of a decoder layer: residual add + RMSNorm, RoPE, SiLU-and-mul.

``TorchLayerOps`` computes them with torch ops, exactly as HF transformers
does. ``NativeLayerOps`` runs each as one pass of a native CPU kernel
(``cpu_kernels.py``) where the tensors allow it (fp32 on CPU) and falls back to
torch elsewhere; RoPE rounds identically, the norm and SiLU within float32
rounding of torch.
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
        if not _fp32_cpu(x) or not x.is_contiguous() \
                or (delta is not None and not delta.is_contiguous()):
            return super().add_norm(x, delta, norm)
        return x, self.kernels.add_rms_norm(x, delta, norm.weight, norm.eps)  # x updated in place

    def rope(self, rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_fp32_cpu(q) and _fp32_cpu(rope.cos)):
            return super().rope(rope, q, k, positions)
        self.kernels.rope_(q, k, rope.cos, rope.sin, positions)
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not _fp32_cpu(gate_up) or not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up)


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"
