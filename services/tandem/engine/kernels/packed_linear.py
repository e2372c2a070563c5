"""fp32 linears on the native packed layout (``csrc/packed_linear.c``).

A weight ``[N, K]`` is packed once into panels of 32 output channels, K-major:
``[ceil(N / 32), K, 32]`` (the last panel zero-padded). One kernel then runs every row
count: a decode step of a few rows streams each panel from memory once, and a prompt
of many rows runs at the FMA rate (on par with oneDNN's blocked layout). Each output is
the same FMA chain over k whatever the batch, so a row's result does not depend on its
batch. Unlike oneDNN's blocked layout, C can read it, so the decode stack runs on it.
An MLP's gate|up weight also runs as one call with its SiLU·mul (``gate_up_silu``).
A tied LM head is packed too, and the embedding lookup reads its rows from the packed
weight (``PackedEmbedding``): the table is stored once, in the layout the head streams.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from tandem.engine import huge_pages
from tandem.engine.kernels import cpu_features, cpu_kernels, kernel_choice
from tandem.engine.kernels.cpu_kernels import CpuKernels, bind

PANEL = 32  # TANDEM_PACK_WIDTH in csrc/kernels.h

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PackedKernels:
    """The packing and product entries of the loaded kernel library."""

    def __init__(self, kernels: CpuKernels) -> None:
        lib = kernels.lib
        self._pack = bind(lib, "tandem_pack_linear_f32", None, _ptr, _ptr, _i64, _i64)
        self._linear = bind(lib, "tandem_packed_linear_f32", None,
                            _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64)
        self._gate_up_silu = bind(lib, "tandem_packed_gate_up_silu_f32", None,
                                  _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` fp32 -> its packed copy ``[ceil(N / 32), K, 32]``."""
        return packed_copy(self._pack, weight, "packed", torch.float32,
                           lambda n, k: ((n + PANEL - 1) // PANEL, k, PANEL))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               n_out: int) -> torch.Tensor:
        """``x [M, K] @ W.T + bias`` -> ``[M, n_out]`` fp32, with ``packed`` from ``pack(W)``."""
        self._check(x, packed, bias, n_out)
        out = x.new_empty(x.shape[0], n_out)
        if x.shape[0]:
            self._linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                         out.data_ptr(), x.shape[0], n_out, x.shape[1])
        return out

    @staticmethod
    def _check(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> None:
        check_fp32_operands("packed linears", x, packed, bias)
        if x.dim() != 2 or packed.dim() != 3 or packed.shape[1] != x.shape[1] \
                or packed.shape[2] != PANEL or not 0 < n_out <= packed.shape[0] * PANEL \
                or n_out <= (packed.shape[0] - 1) * PANEL \
                or (bias is not None and bias.shape != (n_out,)):
            raise ValueError(f"packed linear: x {tuple(x.shape)}, packed {tuple(packed.shape)}, "
                             f"{n_out} outputs do not fit")

    @staticmethod
    def fuses_gate_up(n_out: int) -> bool:
        """Whether a gate|up product of ``n_out`` outputs can run as ``gate_up_silu``: its gate
        and up halves start on panel boundaries."""
        return n_out % (2 * PANEL) == 0

    def gate_up_silu(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     n_out: int) -> torch.Tensor:
        """``silu(gate) * up`` of the fused product ``x [M, K] @ W.T + bias`` (``W [n_out, K]``,
        gate rows then up rows, packed by ``pack``) -> ``[M, n_out / 2]``, bit-identical to
        ``linear`` then ``CpuKernels.silu_mul`` but without the product written out."""
        if not self.fuses_gate_up(n_out):
            raise ValueError(f"gate|up fusion needs outputs in whole pairs of panels, got {n_out}")
        self._check(x, packed, bias, n_out)
        out = x.new_empty(x.shape[0], n_out // 2)
        if x.shape[0]:
            self._gate_up_silu(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                               out.data_ptr(), x.shape[0], n_out // 2, x.shape[1])
        return out


def packed_copy(pack: ctypes._CFuncPtr, weight: torch.Tensor, layout: str, dtype: torch.dtype,
                shape: Callable[[int, int], tuple[int, ...]]) -> torch.Tensor:
    """``weight [N, K]`` of ``dtype`` packed by the native ``pack(src, dst, N, K)`` into a new
    tensor of ``shape(N, K)`` (on huge pages where available)."""
    if weight.dtype != dtype or weight.dim() != 2 or weight.device.type != "cpu":
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}.get(dtype, str(dtype))
        raise ValueError(f"the {layout} layout takes {name} CPU weights [N, K]")
    weight = weight.contiguous()
    n, k = weight.shape
    packed = huge_pages.empty(shape(n, k), dtype)
    pack(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def check_fp32_operands(what: str, *tensors: torch.Tensor | None) -> None:
    """ValueError unless every tensor given (None: an absent bias) is a contiguous fp32 CPU
    tensor, as the native linears read them."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"
                              or not t.is_contiguous()):
            raise ValueError(f"{what} need contiguous fp32 CPU tensors")


def check_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """Raise IndexError unless every id names a row of the table: a packed table's padding
    holds no rows, and indexing it would not fail."""
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < num_embeddings):
        raise IndexError(f"token ids must lie in [0, {num_embeddings})")


class PackedEmbedding(nn.Module):
    """An embedding table read from a packed weight ``[ceil(V / 32), K, 32]`` (a tied LM
    head's): row ``n`` is column ``n % 32`` of panel ``n // 32``. A lookup gathers K floats
    32 apart, a cache line each: slower than from a plain table on a long prompt, but the
    head product it saves a second copy for runs faster on the packed weight than on the
    plain table at decode and prompt sizes (services/RESULTS.md)."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int) -> None:
        super().__init__()
        if packed.dim() != 3 or packed.shape[2] != PANEL or num_embeddings > packed.shape[0] * PANEL:
            raise ValueError(f"a packed table of {num_embeddings} rows, not {tuple(packed.shape)}")
        self.weight = packed  # the head's tensor, not a copy (and not a parameter of this module)
        self.num_embeddings = num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` int64 -> ``[..., K]`` fp32 rows."""
        check_ids(ids, self.num_embeddings)
        return self.weight[ids // PANEL, :, ids % PANEL]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.weight.shape[1]}, packed"


@cache
def load() -> PackedKernels | None:
    """The packed kernels where they are fast: a CPU with AVX-512, or AVX2 and FMA (the
    portable loop is far slower than oneDNN on prompts, so layers keep oneDNN elsewhere),
    and a native library that builds; else None."""
    if not kernel_choice.packed_fp32(cpu_features.cpu_flags()):
        return None
    kernels = cpu_kernels.load()
    return None if kernels is None else PackedKernels(kernels)
