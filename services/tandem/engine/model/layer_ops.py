"""The elementwise steps of a decoder layer: residual add + RMSNorm, RoPE, SiLU-and-mul
(and the MLP around it).

``TorchLayerOps`` computes them with torch ops, exactly as HF transformers
does. ``NativeLayerOps`` (installed only on a CPU model with fp32 activations) runs each as one
pass of a native CPU kernel (``cpu_kernels.py``, which checks its tensors);
RoPE rounds identically, the norm and SiLU within float32 rounding of torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.kernels.cpu_kernels import CpuKernels
from tandem.engine.kernels.onednn import CpuLinear
from tandem.engine.model.rope import RotaryEmbedding


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

    def mlp(self, h: torch.Tensor, gate_up: torch.nn.Module,
            down: torch.nn.Module) -> torch.Tensor:
        """``down(silu(gate) * up)`` of ``h [T, hidden]`` with the fused ``gate_up``."""
        return down(self.silu_mul(gate_up(h)))


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

    def mlp(self, h: torch.Tensor, gate_up: torch.nn.Module,
            down: torch.nn.Module) -> torch.Tensor:
        """On packed fp32 and AMX weights the gate|up product and SiLU·mul are one native
        call (the product is not written out; the same values); on AMX weights the down
        product joins that call (the SiLU·mul handed over in bf16, as ``down`` rounds it);
        the AVX-512 bf16 kernels run the two products and SiLU·mul apart. With bf16 weights
        on oneDNN, gate|up stays bf16 into SiLU·mul and its bf16 result goes to ``down`` as is: the values
        ``down`` would get from the widened product (it rounds its input to bf16 anyway), in
        half the memory traffic."""
        rows = h.shape[0]
        packed = gate_up.packed if isinstance(gate_up, CpuLinear) else None
        if packed is not None and packed.fuses_gate_up(gate_up.out_features):  # SiLU·mul in the product
            if isinstance(down, CpuLinear) and down.packed is packed and hasattr(packed, "mlp") \
                    and down.in_features * 2 == gate_up.out_features \
                    and down.packed_options.get("round_output", True):  # the MLP in one call
                return packed.mlp(h.contiguous(), gate_up.weight, gate_up.bias, gate_up.out_features,
                                  down.weight, down.bias, down.out_features)
            return down(packed.gate_up_silu(h.contiguous(), gate_up.weight, gate_up.bias,
                                            gate_up.out_features))
        if isinstance(gate_up, CpuLinear) and isinstance(down, CpuLinear) \
                and gate_up.weight.dtype == down.weight.dtype == torch.bfloat16 \
                and gate_up.runs_on_onednn(rows) and down.runs_on_onednn(rows):
            return down(self.kernels.silu_mul(gate_up.product(h)))
        return super().mlp(h, gate_up, down)
