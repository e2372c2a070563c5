"""Weight-only int8 linears (per output channel) for the CPU path.

Each weight row ``W[n, :]`` is stored as int8 with one fp32 scale,
``max|W[n, :]| / 127``; activations stay fp32. Where the native kernels build, the int8
weight is packed once like the fp32 packed layout (``csrc/int8_linear.c``: panels of 32
output channels, K-major, ``[ceil(N / 32), K, 32]``) and one kernel runs every row
count, widening each weight once per tile: a decode step reads a quarter of the fp32
bytes, and each output is the same FMA chain whatever the batch (a row's result does
not depend on its batch), so the decode stack runs on it too. Without them, the weight
stays ``[N, K]`` and each call dequantizes it for one fp32 matmul.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.kernels import cpu_kernels
from tandem.engine.kernels.cpu_kernels import CpuKernels, bind
from tandem.engine.kernels.packed_linear import PANEL, check_fp32_operands, packed_copy

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (``[N, K]`` int8, ``[N]`` fp32 scales), symmetric per row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Kernels:
    """The packing and product entries of the loaded kernel library."""

    def __init__(self, kernels: CpuKernels) -> None:
        self._pack = bind(kernels.lib, "tandem_pack_int8", None, _ptr, _ptr, _i64, _i64)
        self._linear = bind(kernels.lib, "tandem_int8_linear_f32", None,
                            _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64)

    def pack(self, qweight: torch.Tensor) -> torch.Tensor:
        """``qweight [N, K]`` int8 -> ``[ceil(N / 32), K, 32]`` int8, the last panel zero-padded."""
        return packed_copy(self._pack, qweight, "int8 packed", torch.int8,
                           lambda n, k: ((n + PANEL - 1) // PANEL, k, PANEL))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
        """``(x [M, K] @ W.T) * scale + bias`` -> ``[M, n_out]`` fp32, ``packed = pack(W)``."""
        check_fp32_operands("int8 linears' inputs, scales and bias", x, scale, bias)
        if x.dim() != 2 or packed.dtype != torch.int8 \
                or packed.shape != ((n_out + PANEL - 1) // PANEL, x.shape[1], PANEL) \
                or scale.shape != (n_out,) or (bias is not None and bias.shape != (n_out,)):
            raise ValueError(f"int8 linear: x {tuple(x.shape)}, packed {tuple(packed.shape)}, "
                             f"{n_out} outputs do not fit")
        out = x.new_empty(x.shape[0], n_out)
        if x.shape[0]:
            self._linear(x.data_ptr(), packed.data_ptr(), scale.data_ptr(),
                         None if bias is None else bias.data_ptr(), out.data_ptr(),
                         x.shape[0], n_out, x.shape[1])
        return out


@cache
def load() -> Int8Kernels | None:
    """The int8 kernels where the native library builds; else None."""
    kernels = cpu_kernels.load()
    return None if kernels is None else Int8Kernels(kernels)


class Int8Linear(nn.Module):
    """``x [..., in] @ dequant(W).T + b`` with int8 ``W`` and fp32 per-row scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: bool = True) -> None:
        """``native``: the native kernel may run it (on a CPU weight, where it builds)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, self.scale = quantize_rows(weight)  # [N, K] int8, [N] fp32
        self.bias = None if bias is None else bias.detach().float().clone()
        self.kernels = load() if native and weight.device.type == "cpu" else None
        # packed [ceil(N / 32), K, 32] for the kernel, else [N, K]
        self.qweight = q if self.kernels is None else self.kernels.pack(q)
        # input rows up to which the native kernel runs the product (all of them), as CpuLinear
        self.native_rows = 0 if self.kernels is None else sys.maxsize

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` this layer computes with."""
        q = self.qweight
        if self.kernels is not None:  # panels back to rows
            q = q.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]
        return q.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.kernels is not None:
            y = self.kernels.linear(flat.contiguous(), self.qweight, self.scale, self.bias,
                                    self.out_features)
        else:
            y = F.linear(flat, self.dequantized(), self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors this layer stores (``LlamaModel.weight_bytes`` counts them)."""
        return [t for t in (self.qweight, self.scale, self.bias) if t is not None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(model: nn.Module, native: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` by an ``Int8Linear`` (``native``: on the
    native kernel where it builds); returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child.weight, child.bias, native))
    return len(targets)
