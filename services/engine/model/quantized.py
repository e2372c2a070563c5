"""Weight-only int8 linears (per output channel) for the CPU path.

Each weight row ``W[n, :]`` is stored as int8 with one fp32 scale,
``max|W[n, :]| / 127``; activations stay fp32. Decode-sized inputs (a few
rows) go through a native kernel reading the int8 rows directly (a quarter of
the fp32 bytes); larger ones (prefill chunks) dequantize the weight once per
call and run one fp32 matmul, where the products, not the weight reads, cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model import cpu_kernels

# Up to this many input rows the int8 kernel; above it, dequantize + fp32 matmul.
NATIVE_MAX_ROWS = 16


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``[N, K]`` int8, ``[N]`` fp32 scales), symmetric per row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """``x [..., in] @ dequant(W).T + b`` with int8 ``W`` and fp32 per-row scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qweight, self.scale = quantize_rows(weight)  # [N, K] int8, [N] fp32
        self.bias = None if bias is None else bias.detach().float().clone()
        self.kernels = cpu_kernels.load() if weight.device.type == "cpu" else None

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` this layer computes with."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.kernels is not None and flat.shape[0] <= NATIVE_MAX_ROWS:
            y = self.kernels.int8_linear(flat.contiguous(), self.qweight, self.scale, self.bias)
        else:
            y = F.linear(flat, self.dequantized(), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors this layer stores (``LlamaModel.weight_bytes`` counts them)."""
        return [t for t in (self.qweight, self.scale, self.bias) if t is not None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an ``Int8Linear``; returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child.weight, child.bias))
    return len(targets)
