"""bf16 linears on AMX tiles (``csrc/amx_linear.c``): the packed layout for bf16 weights.

A weight ``[N, K]`` bf16 is packed once into 1 KB blocks of 16 outputs x 32 inputs in the
tile product's pair-interleaved layout. A call rounds its fp32 input to bf16, accumulates
in fp32 on the tiles and rounds each output (bias added) to bf16, returned as fp32: the
values oneDNN's bf16 product gives, up to the order of the fp32 sums. Each output is the
same accumulation whatever the batch, so a row's result does not depend on its batch.
Over SmolLM2-135M's shapes on 2 threads of an Intel Xeon with AMX it is 1.0-1.8x oneDNN's
blocked bf16 product with its input and output conversions at 256-1,024 rows (gate|up at
1,024 rows level with it) and 1.75-2.6x at 32 (services/bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from services.engine.model import cpu_features, cpu_kernels
from services.engine.model.cpu_kernels import CpuKernels, bind
from services.engine.model.packed_linear import packed_copy

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def packed_numel(n: int, k: int) -> int:
    """Elements of a packed ``[n, k]`` weight: 16-output blocks (an even number of them)
    of 32-input blocks, 512 each."""
    return ((n + 15) // 16 + 1) // 2 * 2 * ((k + 31) // 32) * 512


class AmxLinearKernels:
    """The packing and product entries of the loaded kernel library."""

    def __init__(self, kernels: CpuKernels) -> None:
        lib = kernels.lib
        self._pack = bind(lib, "tandem_amx_pack_linear", None, _ptr, _ptr, _i64, _i64)
        self._linear = bind(lib, "tandem_amx_linear", ctypes.c_int,
                            _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` bf16 -> its packed copy, flat (``packed_numel(N, K)`` elements)."""
        return packed_copy(self._pack, weight, "AMX", torch.bfloat16,
                           lambda n, k: (packed_numel(n, k),))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               n_out: int) -> torch.Tensor:
        """``bf16(x [M, K] @ W.T + bias)`` -> ``[M, n_out]`` fp32, with ``packed`` from
        ``pack(W)``; ``x`` and ``bias`` fp32."""
        for t in (x, *(() if bias is None else (bias,))):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("AMX linears need contiguous fp32 CPU inputs and bias")
        if x.dim() != 2 or packed.dtype != torch.bfloat16 \
                or packed.numel() != packed_numel(n_out, x.shape[1]) \
                or (bias is not None and bias.shape != (n_out,)):
            raise ValueError(f"AMX linear: x {tuple(x.shape)}, {packed.numel()} packed elements, "
                             f"{n_out} outputs do not fit")
        out = x.new_empty(x.shape[0], n_out)
        if x.shape[0]:
            rc = self._linear(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n_out,
                              None if bias is None else bias.data_ptr(), out.data_ptr())
            if rc != 0:
                raise MemoryError("the AMX linear could not allocate its bf16 input")
        return out

    @staticmethod
    def fuses_gate_up(n_out: int) -> bool:
        """No fused gate|up here: the MLP takes the product, then SiLU·mul."""
        return False


@cache
def load() -> AmxLinearKernels | None:
    """The AMX kernels where the CPU has AMX-BF16 tiles, Linux grants them to this process
    and the native library builds; else None."""
    if not cpu_features.has_amx_bf16():
        return None
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.lib.tandem_amx_linear_supported():
        return None
    return AmxLinearKernels(kernels)
