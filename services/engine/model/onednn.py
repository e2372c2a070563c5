"""The CPU path's linear layers: oneDNN matmuls, and a native GEMV for decode-sized inputs.

``torch.nn.functional.linear`` on CPU (MKL) runs the products of a serving step
at ~120-190 GFLOP/s here; oneDNN's ``_linear_pointwise`` runs them at ~150-220.
It runs them on a weight reordered once into its blocked layout
(``_reorder_linear_weight``): over a whole model's layers, whose weights no cache
holds, a decode step of 4-64 rows ran its products 1.2-1.45x faster than on the
plain layout in fp32 (1.5-2x in bf16), prompt chunks 1.04-1.14x. The native GEMV
(``cpu_kernels.gemv``, ``csrc/gemv.c``) needs the plain layout. Over SmolLM2-135M's
layers on 2 threads of an Intel Xeon with AMX (fp32): 1 row 18.8 ms against 24.6 on
the blocked layout and 30.4 on the plain one, 4 rows 23.0 / 28.3 / 40.0, 8 rows
33.5 / 33.7 / 45.5, 16 rows 53.8 / 40.7 / 52.4 (where its whole-stack call,
``decode_stack.py``, saves more than the gap): so fp32 takes it up to 16 rows (steps
the stack cannot take, mixed ones or layers with q/k norms, gain nothing at 9-16). In bf16
oneDNN runs on AMX tiles and the GEMV wins only at 1-2 rows. Each weight is stored
once: layers take the blocked layout and oneDNN for every input (``blocked=False``,
``--cpu-weight-layout plain``: the plain layout, and the GEMV for decode-sized
inputs). A tied LM head is the embedding table, so it stays plain and keeps the GEMV.

Activations stay fp32; with bf16 weights the input is rounded to bf16 for the
product (oneDNN's, or the GEMV's, which widens both to fp32) and the output to bf16,
as oneDNN returns it, before it is fp32 again: a row's result does not depend on
which path ran it. Results differ from MKL's only in float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.model import cpu_kernels

# Input rows up to which the GEMV beats oneDNN, per weight dtype (bf16 widens each
# weight element, so it turns compute-bound sooner, and oneDNN has AMX for it).
GEMV_MAX_ROWS = {torch.float32: cpu_kernels.GEMV_MAX_ROWS, torch.bfloat16: 2}


def available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class CpuLinear(nn.Module):
    """An ``nn.Linear`` on the CPU path: ``x [..., in] @ W.T + b``, fp32 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32, gemv: bool = True, blocked: bool = True,
                 shared: bool = False) -> None:
        """``weight [out, in]``; ``blocked``: in oneDNN's blocked layout;
        ``shared``: it is also read elsewhere (a tied LM head's embedding table), so it
        stays plain and is not copied."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        plain = weight.detach().to(dtype).contiguous()  # no copy when ``weight`` already is one
        self.blocked = blocked and not shared
        # [out, in]: plain, or oneDNN's blocked layout (an opaque tensor)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(plain, None) if self.blocked else plain
        # oneDNN adds the bias in ``dtype``; the GEMV gets the same values widened (one
        # tensor for fp32)
        self.onednn_bias = None if bias is None else bias.detach().to(dtype).clone()
        self.bias = None if self.onednn_bias is None else self.onednn_bias.float()
        # None: oneDNN for every input
        self.kernels = cpu_kernels.load() if gemv and not self.blocked else None
        self.gemv_rows = GEMV_MAX_ROWS.get(dtype, 0) if self.kernels is not None else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.gemv_rows:
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
        return rows > self.gemv_rows

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` (fp32, or already in the weight's dtype) @ W.T + b by oneDNN, in
        the weight's dtype ``[T, out]``."""
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
               f"dtype={self.weight.dtype}, blocked={self.blocked}"


def replace_linears(model: nn.Module, dtype: torch.dtype = torch.float32, gemv: bool = True,
                    blocked: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``CpuLinear`` (``gemv``: decode-sized
    inputs on the native GEMV where the weight is plain; ``blocked``: weights in
    oneDNN's layout); returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, CpuLinear(child.weight, child.bias, dtype, gemv, blocked))
    return len(targets)
