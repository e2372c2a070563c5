"""The CPU path's linear layers: a native packed kernel, oneDNN matmuls, a native GEMV.

Each weight is stored once, in one of three layouts (``--cpu-weight-layout``):

- **packed** (the default for fp32): panels of 32 output channels, K-major, for the
  native kernel of ``packed_linear.py``, which runs every row count. It keeps up with
  oneDNN's blocked layout on prompts and beats it on decode steps, which stream the
  weights (services/RESULTS.md, "one packed layout for every fp32 step"), and C can read
  it, so a decode step of any batch runs all its layers in one
  native call (``decode_stack.py``). bf16 weights asked to be packed take the AMX layout
  where the CPU has AMX-BF16 (``amx_linear.py``: 16 x 32 blocks for the tile products,
  every row count, faster than the blocked layout's bf16 products with their conversions),
  the same blocks on AVX-512 where it has AVX-512 BF16 without AMX (``BF16_AVX512``:
  ``bf16_avx512_linear.py``, every row count, batch-invariant; faster than oneDNN's bf16
  products on decode steps), blocked elsewhere; all weights take blocked on
  CPUs without AVX-512 or AVX2 + FMA, or without the native kernels.
- **blocked**: oneDNN's ``_linear_pointwise`` on a weight reordered once into its blocked
  layout (``_reorder_linear_weight``, an opaque tensor): in bf16 it runs on AMX tiles.
- **plain**: ``[out, in]`` as loaded; oneDNN, and the native GEMV (``cpu_kernels.gemv``,
  ``csrc/gemv.c``) for decode-sized inputs (up to 16 rows fp32, 2 bf16). A tied LM head
  is the embedding table: packed (fp32, or bf16 where the CPU has AMX-BF16 or AVX-512 BF16,
  where a bf16 head always is), the
  lookup reads the packed head (``packed_linear.PackedEmbedding``,
  ``amx_linear.AmxEmbedding``); otherwise the head reads the plain table.

Activations stay fp32; with bf16 weights the input is rounded to bf16 for the
product (oneDNN's, the native bf16 kernels', or the GEMV's, which widens both to fp32) and the
output to bf16, as oneDNN returns it, before it is fp32 again: every path rounds alike.
The order of the sums is each path's own: the native kernels' does not depend on the
row count (a row computes alike alone and in any batch), oneDNN's can (a row of
SmolLM2's bf16 head product moved by a bf16 step with the batch's row count on an Intel
Xeon with AMX). Results differ from MKL's only in float rounding.

The LM head is the exception where the CPU has AMX-BF16 or AVX-512 BF16: a bf16 head is
packed for the native kernel whatever the layers' layout (``head_layout``) and returns its
fp32 sums unrounded. Rounded, logits of 16-32 move in steps of 0.125, two near-tied tokens round
to one value and the tie goes to the lower id; a pool on oneDNN's head and one on the
native head then pick different first tokens for the same prompt.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from tandem.common.config import CPU_WEIGHT_LAYOUTS as LAYOUTS
from tandem.engine import huge_pages
from tandem.engine.kernels import (amx_linear, bf16_avx512_linear, cpu_features, cpu_kernels, kernel_choice, packed_linear)
from tandem.engine.kernels.kernel_choice import AMX, BF16_AVX512

# storage layouts, not options: bf16 weights packed for AMX tiles, or the same blocks for
# the AVX-512 kernels on a CPU with AVX-512 BF16 but without AMX
PAIR_PACKED = (AMX, BF16_AVX512)

# Input rows up to which the GEMV beats oneDNN, per weight dtype (bf16 widens each
# weight element, so it turns compute-bound sooner, and oneDNN has AMX for it).
GEMV_MAX_ROWS = {torch.float32: cpu_kernels.GEMV_MAX_ROWS, torch.bfloat16: 2}


def available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class CpuLinear(nn.Module):
    """An ``nn.Linear`` on the CPU path: ``x [..., in] @ W.T + b``, fp32 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32, native: bool = True,
                 layout: str = "blocked", shared: bool = False, logits: bool = False) -> None:
        """``weight [out, in]``; ``native``: the native kernels may run it; ``layout``:
        blocked | plain | packed (see ``storage_layout``); ``shared``: it is also read
        elsewhere (a tied LM head's embedding table), so it stays plain and is not copied;
        ``logits``: an LM head, whose output the bf16 kernels leave unrounded."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_options: dict = {}  # the packed kernel's options, beyond its operands
        plain = weight.detach().to(dtype).contiguous()  # no copy when ``weight`` already is one
        self.layout = "plain" if shared else storage_layout(layout, dtype, native)
        if self.layout == "packed":
            self.packed = packed_linear.load()
            self.weight = self.packed.pack(plain)  # [ceil(out / 32), in, 32]
        elif self.layout in PAIR_PACKED:
            self.packed = amx_linear.load() if self.layout == AMX else bf16_avx512_linear.load()
            self.weight = self.packed.pack(plain)  # flat: 16 x 32 blocks
            self.packed_options = {"round_output": not logits}
        else:  # [out, in]: plain, or oneDNN's blocked layout (an opaque tensor)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(plain, None) \
                if self.layout == "blocked" else plain if shared else huge_pages.copy_of(plain)
            self.packed = None
        # oneDNN adds the bias in ``dtype``; the native kernels get the same values widened
        # (one tensor for fp32)
        self.onednn_bias = None if bias is None else bias.detach().to(dtype).clone()
        self.bias = None if self.onednn_bias is None else self.onednn_bias.float()
        # the GEMV, for decode-sized inputs on a plain weight
        self.kernels = cpu_kernels.load() if native and self.layout == "plain" else None
        # input rows up to which a native kernel runs the product (packed: all of them)
        self.native_rows = sys.maxsize if self.packed is not None else \
            GEMV_MAX_ROWS.get(dtype, 0) if self.kernels is not None else 0

    @property
    def blocked(self) -> bool:
        return self.layout == "blocked"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.packed is not None:
            y = self.packed.linear(flat.contiguous(), self.weight, self.bias, self.out_features,
                                   **self.packed_options)
        elif flat.shape[0] <= self.native_rows:
            # input and output rounded to ``dtype`` as oneDNN rounds them (no-ops for fp32):
            # a token's logits must not depend on how many rows its step had
            rounded = flat.to(self.weight.dtype).float().contiguous()
            y = self.kernels.gemv(rounded, self.weight, self.bias).to(self.weight.dtype).float()
        else:
            y = self.product(flat).float()
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def runs_on_onednn(self, rows: int) -> bool:
        """Whether ``rows`` rows go to oneDNN (not the GEMV), which computes in the
        weight's dtype: then ``product`` is ``forward`` without the widening."""
        return rows > self.native_rows

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` (fp32, or already in the weight's dtype) @ W.T + b by oneDNN, in
        the weight's dtype ``[T, out]`` (plain or blocked weights)."""
        if x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.onednn_bias,
                                                  "none", [], "")

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors this layer stores (``LlamaModel.weight_bytes`` counts shared ones once;
        a blocked weight is an opaque tensor without a data pointer)."""
        return [t for t in (self.weight, self.bias, self.onednn_bias) if t is not None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"dtype={self.weight.dtype}, layout={self.layout}"


def storage_layout(layout: str, dtype: torch.dtype, native: bool) -> str:
    """The layout a weight of ``dtype`` is stored in when ``layout`` (blocked | plain |
    packed) is asked for: packed needs the native kernels (``native``); in fp32 on a CPU
    with AVX-512 or AVX2 + FMA (``packed_linear.load()``), in bf16 on one with AMX-BF16
    (``AMX``: ``amx_linear.load()``) or else AVX-512 BF16 (``BF16_AVX512``:
    ``bf16_avx512_linear.load()``); otherwise it falls back to blocked."""
    if layout not in LAYOUTS:
        raise ValueError(f"CPU weight layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "packed" and dtype == torch.bfloat16 and native:
        for chosen in kernel_choice.bf16_layouts(cpu_features.cpu_flags()):
            loader = amx_linear.load if chosen == AMX else bf16_avx512_linear.load
            if loader() is not None:
                return chosen
    if layout == "packed" and not (dtype == torch.float32 and native and packed_linear.load() is not None):
        return "blocked"
    return layout


def head_layout(layout: str, dtype: torch.dtype, native: bool) -> str:
    """The layout an LM head of ``dtype`` is asked for beside layers in ``layout``: packed
    where that stores bf16 weights for a native kernel (the head's logits then come back
    unrounded, on every pool whatever its layers' layout), else ``layout``."""
    storage_layout(layout, dtype, native)  # checks ``layout``
    if dtype == torch.bfloat16 and storage_layout("packed", dtype, native) in PAIR_PACKED:
        return "packed"
    return layout


def replace_linears(model: nn.Module, dtype: torch.dtype = torch.float32, native: bool = True,
                    layout: str = "blocked") -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``CpuLinear`` in ``layout`` (``native``:
    the native kernels may run them); returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, CpuLinear(child.weight, child.bias, dtype, native, layout))
    return len(targets)
