"""bf16 linears on AMX tiles (``csrc/amx_linear.c``): the packed layout for bf16 weights,
which the AVX-512 bf16 kernels read too (``bf16_avx512_linear``; ``PairPackedKernels``,
their common product).

A weight ``[N, K]`` bf16 is packed once into 1 KB blocks of 16 outputs x 32 inputs in the
tile product's pair-interleaved layout. A call rounds its fp32 input to bf16, accumulates
in fp32 on the tiles and rounds each output (bias added) to bf16, returned as fp32: the
values oneDNN's bf16 product gives, up to the order of the fp32 sums. Each output is the
same accumulation whatever the batch, so a row's result does not depend on its batch.
An MLP's gate|up product can end in its SiLU·mul (``gate_up_silu``), the product never
written out, and a whole MLP run in one call (``mlp``: the SiLU·mul kept in bf16 as the down
product's input). An LM head is packed here whatever the layers' layout and returns its fp32 sums
unrounded (``onednn.head_layout``); a tied one is stored once, the embedding lookup reading
its rows from the packed weight (``AmxEmbedding``). It runs at least level with oneDNN's
blocked bf16 product with its input and output conversions on prompts and well ahead of
it on decode-sized inputs (services/RESULTS.md, "bf16 linears on AMX tiles" and "bf16
prompts on AMX").
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import nn

from tandem.engine.kernels import cpu_features, cpu_kernels
from tandem.engine.kernels.cpu_kernels import CpuKernels, bind
from tandem.engine.kernels.packed_linear import check_fp32_operands, check_ids, packed_copy

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def packed_numel(n: int, k: int) -> int:
    """Elements of a packed ``[n, k]`` weight: 16-output blocks (an even number of them)
    of 32-input blocks, 512 each."""
    return ((n + 15) // 16 + 1) // 2 * 2 * ((k + 31) // 32) * 512


class PairPackedKernels:
    """A product over bf16 weights packed in this module's layout (``pack``): the native
    entry ``linear_entry`` (``tandem_amx_linear``'s signature) computes it; ``name`` says
    which kernel in errors. The AMX kernels add the fused MLP (``AmxLinearKernels``);
    ``bf16_avx512_linear`` runs the same layout on AVX-512."""

    name: str  # the kernel, as errors name it (each subclass sets it)

    def __init__(self, kernels: CpuKernels, linear_entry: str) -> None:
        lib = kernels.lib
        self._pack = bind(lib, "tandem_amx_pack_linear", None, _ptr, _ptr, _i64, _i64)
        self._linear = bind(lib, linear_entry, ctypes.c_int,
                            _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, ctypes.c_int)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` bf16 -> its packed copy, flat (``packed_numel(N, K)`` elements)."""
        return packed_copy(self._pack, weight, self.name, torch.bfloat16,
                           lambda n, k: (packed_numel(n, k),))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               n_out: int, round_output: bool = True) -> torch.Tensor:
        """``bf16(x [M, K] @ W.T + bias)`` -> ``[M, n_out]`` fp32, with ``packed`` from
        ``pack(W)``; ``x`` and ``bias`` fp32. ``round_output=False``: the fp32 sums as they
        are (an LM head's logits)."""
        self._check(x, packed, bias, n_out)
        out = x.new_empty(x.shape[0], n_out)
        if x.shape[0]:
            self._done(self._linear(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n_out,
                                    None if bias is None else bias.data_ptr(), out.data_ptr(),
                                    int(round_output)))
        return out

    def fuses_gate_up(self, n_out: int) -> bool:
        """Whether a gate|up product of ``n_out`` outputs can end in its SiLU·mul
        (``gate_up_silu``, AMX only)."""
        return False

    def _check(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> None:
        check_fp32_operands(f"{self.name} linears' inputs and bias", x, bias)
        if x.dim() != 2:
            raise ValueError(f"{self.name} linear: x {tuple(x.shape)} is not [M, K]")
        self._check_weight(x.shape[1], packed, bias, n_out)

    def _check_weight(self, k_in: int, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> None:
        if packed.dtype != torch.bfloat16 or packed.numel() != packed_numel(n_out, k_in) \
                or (bias is not None and bias.shape != (n_out,)):
            raise ValueError(f"{self.name} linear: {k_in} inputs, {packed.numel()} packed elements, "
                             f"{n_out} outputs do not fit")

    def _done(self, rc: int) -> None:
        """The kernel's return code: 0, -1 (no memory for its bf16 copy of the input), -2
        (the CPU or, for AMX, this process lacks the instructions), -3 (a shape it does
        not take)."""
        if rc == -1:
            raise MemoryError(f"the {self.name} linear could not allocate its bf16 input")
        if rc == -2:
            raise RuntimeError(f"the {self.name} linear cannot run on this CPU or in this process")
        if rc != 0:
            raise ValueError(f"the {self.name} linear refused its operands' shapes (code {rc})")


class AmxLinearKernels(PairPackedKernels):
    """The AMX tile products: every linear, and an MLP's gate|up with its SiLU·mul or the
    whole MLP in one call."""

    name = "AMX"

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__(kernels, "tandem_amx_linear")
        lib = kernels.lib
        self._gate_up_silu = bind(lib, "tandem_amx_gate_up_silu", ctypes.c_int,
                                  _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr)
        self._fuses_gate_up = bind(lib, "tandem_amx_fuses_gate_up", ctypes.c_int, _i64)
        self._fuses: dict[int, bool] = {}  # fuses_gate_up's answers, asked once per layer shape
        self._mlp = bind(lib, "tandem_amx_mlp", ctypes.c_int,
                         _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr)

    def fuses_gate_up(self, n_out: int) -> bool:
        """Whether a gate|up product of ``n_out`` outputs can run as ``gate_up_silu`` (the
        kernel's rule, which the decode stack follows too: halves on 16-output blocks)."""
        fuses = self._fuses.get(n_out)
        if fuses is None:
            fuses = self._fuses[n_out] = n_out % 2 == 0 and bool(self._fuses_gate_up(n_out // 2))
        return fuses

    def gate_up_silu(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     n_out: int) -> torch.Tensor:
        """``silu(gate) * up`` of the fused product ``x [M, K] @ W.T + bias`` (``W [n_out, K]``,
        gate rows then up rows, packed by ``pack``) -> ``[M, n_out / 2]`` fp32, bit-identical
        to ``linear`` then ``CpuKernels.silu_mul`` but without the product written out."""
        if not self.fuses_gate_up(n_out):
            raise ValueError(f"gate|up fusion needs whole 16-output blocks per half, got {n_out}")
        self._check(x, packed, bias, n_out)
        out = x.new_empty(x.shape[0], n_out // 2)
        if x.shape[0]:
            self._done(self._gate_up_silu(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(),
                                          n_out // 2, None if bias is None else bias.data_ptr(),
                                          out.data_ptr()))
        return out

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None,
            n_gate_up: int, down: torch.Tensor, down_bias: torch.Tensor | None,
            n_out: int) -> torch.Tensor:
        """``down(silu(gate) * up)`` of ``x [M, K]`` -> ``[M, n_out]`` fp32, both weights packed
        by ``pack`` (``down`` of ``n_gate_up / 2`` inputs): bit-identical to ``gate_up_silu``
        then ``linear``, the SiLU·mul kept in bf16 inside the call as the down product's
        input."""
        if not self.fuses_gate_up(n_gate_up):
            raise ValueError(f"gate|up fusion needs whole 16-output blocks per half, got {n_gate_up}")
        self._check(x, gate_up, gate_up_bias, n_gate_up)
        check_fp32_operands(f"{self.name} linears' inputs and bias", down_bias)
        self._check_weight(n_gate_up // 2, down, down_bias, n_out)
        out = x.new_empty(x.shape[0], n_out)
        if x.shape[0]:
            self._done(self._mlp(x.data_ptr(), x.shape[0], x.shape[1], gate_up.data_ptr(),
                                 n_gate_up // 2, None if gate_up_bias is None else gate_up_bias.data_ptr(),
                                 down.data_ptr(), n_out, None if down_bias is None else down_bias.data_ptr(),
                                 out.data_ptr()))
        return out


class AmxEmbedding(nn.Module):
    """An embedding table read from an AMX-packed weight (a tied LM head's, flat): row ``n``
    is, in each 32-input block of output block ``n // 16``, the 16 input pairs of output
    ``n % 16``. A lookup reads K / 2 pairs 64 bytes apart; rows come back bf16, as the
    plain table's."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        if packed.dim() != 1 or packed.numel() != packed_numel(num_embeddings, embedding_dim):
            raise ValueError(f"an AMX-packed table of {num_embeddings} x {embedding_dim}, "
                             f"not {packed.numel()} elements")
        self.weight = packed  # the head's tensor, not a copy (and not a parameter of this module)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        k_blocks = (embedding_dim + 31) // 32
        self._pairs = packed.view(torch.int32)  # a bf16 pair per element
        self._block_pairs = k_blocks * 256  # pairs per output block
        # a row's pairs lie 16 apart (one per output of its block), input-major
        self._pair_steps = torch.arange(k_blocks * 16) * 16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` int64 -> ``[..., K]`` bf16 rows."""
        check_ids(ids, self.num_embeddings)
        first = (ids // 16) * self._block_pairs + ids % 16  # [...]: each row's first pair
        pairs = torch.take(self._pairs, first[..., None] + self._pair_steps)  # [..., K / 2]
        return pairs.view(torch.bfloat16)[..., :self.embedding_dim]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, AMX-packed"


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
