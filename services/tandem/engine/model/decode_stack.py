"""Every decoder layer of a decode step in one native call (``csrc/decode_stack.c``).

At small batches a CPU decode step is a chain of products bound by reading the weights;
a Python forward adds the dispatch of many small ops to every layer around them, a large
share of a small model's batch-1 step (services/RESULTS.md). ``DecodeStack`` hands the
whole chain to C, which calls the same kernels in the same order with the same roundings:
the hidden states and the KV written are bit-identical to the Python path's.

It runs where every projection is a ``CpuLinear`` on a native kernel (packed fp32
weights, the default, or bf16 weights packed for AMX or the AVX-512 bf16 kernels, for any number of rows; or plain
weights on the GEMV, up to 16 rows with fp32 weights and 2 with bf16: oneDNN's blocked
layout is opaque to C) or an ``Int8Linear`` on its packed kernel (any number of rows),
the layers have no q/k norms and the embedding table is fp32 or
bf16 (or a tied head's packed weight). ``ModelRunner`` runs a step here when every row is a decode (one token per
sequence), at most ``max_rows`` of them, with no per-layer callback; other steps keep the
Python forward.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from tandem.engine.model.attention import TorchPagedAttention
from tandem.engine.kernels.cpu_kernels import CpuKernels, head_splits
from tandem.engine.kernels.amx_linear import AmxEmbedding
from tandem.engine.kernels.onednn import AMX, BF16_AVX512, CpuLinear
from tandem.engine.kernels.packed_linear import PackedEmbedding
from tandem.engine.kernels.quantized import Int8Linear

if TYPE_CHECKING:
    from tandem.engine.model.llama import LlamaModel

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down",
        "qkv_bias", "o_bias", "gate_up_bias", "down_bias",
        "qkv_scale", "o_scale", "gate_up_scale", "down_scale")]


# BF16_AVX512 weights on the FMA kernel (a kind of weights the stack runs, not a layout)
_BF16_AVX512_FMA = "bf16-avx512-fma"
# TANDEM_WEIGHTS_* in csrc/decode_stack.c: the (layout, dtype) of weights the stack runs,
# and on BF16_AVX512 the kernel that runs them (vdpbf16ps, or FMAs over widened weights)
_WEIGHTS = {("plain", torch.float32): 0, ("plain", torch.bfloat16): 1, ("packed", torch.float32): 2,
            (AMX, torch.bfloat16): 3, ("int8", torch.int8): 4, (BF16_AVX512, torch.bfloat16): 5,
            (_BF16_AVX512_FMA, torch.bfloat16): 6}


def _weights_kind(lin: torch.nn.Module) -> tuple[str, torch.dtype] | None:
    """The ``_WEIGHTS`` key of a projection the stack can run (on a native kernel), else None."""
    if not isinstance(lin, (CpuLinear, Int8Linear)) or lin.native_rows == 0:
        return None
    if isinstance(lin, Int8Linear):
        return "int8", torch.int8
    if lin.layout == BF16_AVX512 and lin.packed.fma:
        return _BF16_AVX512_FMA, lin.weight.dtype
    return lin.layout, lin.weight.dtype


def _weight_and_scale(lin: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's stored weight, and its per-output scales (int8; else None)."""
    return (lin.qweight, lin.scale) if isinstance(lin, Int8Linear) else (lin.weight, None)


def _table_kind(embed: torch.nn.Module) -> int:
    """TANDEM_TABLE_*: the embedding table plain fp32 or bf16, or a tied head's packed weight."""
    if isinstance(embed, PackedEmbedding):
        return 2
    if isinstance(embed, AmxEmbedding):
        return 3
    return int(embed.weight.dtype == torch.bfloat16)


class _Stack(ctypes.Structure):
    _fields_ = [*((name, _i64) for name in (
        "num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
        "window", "vocab")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("weights", ctypes.c_int32), ("table", ctypes.c_int32), ("kv_bf16", ctypes.c_int32),
        ("embed", _ptr),
        ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr), ("layers", ctypes.POINTER(_Layer))]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStack:
    def __init__(self, model: LlamaModel, kernels: CpuKernels) -> None:
        """Use ``build``, which checks that ``model`` fits. The stack holds pointers to the
        model's weights, norms, RoPE and embedding tables, so it is built last, once they
        are final (``LlamaModel.use_cpu_kernels``), and keeps those tensors alive."""
        cfg, layers = model.config, model.layers
        qkv = layers[0].qkv_proj
        self.max_rows = qkv.native_rows
        self.shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)
        tensors = [model.rope.cos, model.rope.sin, model.norm.weight]
        rows = []
        for lay in layers:
            weights, scales = zip(*(_weight_and_scale(getattr(lay, n)) for n in _PROJECTIONS))
            per_layer = [lay.input_layernorm.weight, lay.post_attention_layernorm.weight, *weights,
                         *(getattr(lay, n).bias for n in _PROJECTIONS), *scales]
            tensors += [t for t in per_layer if t is not None]
            rows.append(_Layer(*(_ptr_of(t) for t in per_layer)))
        table = model.embed_tokens.weight
        self._tensors = (*tensors, table)  # what the pointers below point into
        self._layers = (_Layer * len(rows))(*rows)
        attn = model.attn
        self._stack = _Stack(
            len(layers), cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, 0, attn.sliding_window or 0, model.embed_tokens.num_embeddings,
            model.norm.eps, attn.scale, _WEIGHTS[_weights_kind(qkv)],
            _table_kind(model.embed_tokens), 0, table.data_ptr(),
            model.rope.cos.data_ptr(), model.rope.sin.data_ptr(), model.norm.weight.data_ptr(),
            self._layers)
        fn = self._fn = kernels.lib.tandem_decode_stack
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Stack), _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                       _i64, _ptr, _i64, _i64]

    @classmethod
    def build(cls, model: LlamaModel, kernels: CpuKernels) -> DecodeStack | None:
        """The stack for ``model``, or None where it does not fit (see the module docstring)."""
        if not isinstance(model.attn, TorchPagedAttention) or model.attn.kernels is None \
                or model.rope is None or model.rope.cos.dtype != torch.float32:
            return None
        linears = [getattr(lay, name) for lay in model.layers for name in _PROJECTIONS]
        kinds = {_weights_kind(lin) for lin in linears}
        if not linears or not kinds <= _WEIGHTS.keys():  # (None is not a key)
            return None
        if len(kinds) != 1 or any(lay.q_norm is not None for lay in model.layers):
            return None
        table = model.embed_tokens.weight  # [vocab, hidden], or packed (PackedEmbedding, AmxEmbedding)
        if table.dtype not in (torch.float32, torch.bfloat16) or not table.is_contiguous():
            return None
        norms = [model.norm.eps, *(n.eps for lay in model.layers
                                   for n in (lay.input_layernorm, lay.post_attention_layernorm))]
        if len(set(norms)) != 1:
            return None
        return cls(model, kernels)

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            block_ids: list[list[int]], kv_cache: torch.Tensor) -> torch.Tensor:
        """A decode step of ``M = len(ids)`` sequences, one token each: row ``r`` is token
        ``ids[r]`` at ``positions[r]``, its K/V going to cache slot ``slots[r]``, the
        sequence's blocks ``block_ids[r]`` (at least those up to its position);
        ``kv_cache [L, 2, blocks, block_size, KVH, D]`` fp32 or bf16. Returns the
        final-normed hidden states ``[M, hidden]``.

        The indices travel as one int64 tensor and the embedding rows are gathered in C:
        a step's host work is a handful of small ops, each slow after the weights' stream
        has flushed the CPU caches."""
        rows = len(ids)
        layers, kv_heads, head_dim, hidden = self.shape
        if kv_cache.dtype not in (torch.float32, torch.bfloat16) or not kv_cache.is_contiguous() \
                or kv_cache.dim() != 6 or (kv_cache.shape[0], kv_cache.shape[1]) != (layers, 2) \
                or (kv_cache.shape[4], kv_cache.shape[5]) != (kv_heads, head_dim) \
                or not rows == len(positions) == len(slots) == len(block_ids):
            raise ValueError("the decode stack needs one position, slot and block list per token "
                             "and an fp32 or bf16 cache [L, 2, blocks, bs, KVH, D]")
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"the decode stack takes 1..{self.max_rows} rows on these weights, "
                             f"not {rows}")
        bs = kv_cache.shape[3]
        used = [p // bs + 1 for p in positions]
        width = max(used)
        # padded with -1: a row whose list lacks a block it reads is refused in C
        table = [b for blocks, n in zip(block_ids, used)
                 for b in (*blocks[:n], *(-1,) * (width - len(blocks[:n])))]
        index = torch.tensor([*ids, *positions, *slots, *range(rows), *table], dtype=torch.long)
        at = index.data_ptr()  # ids | positions (= each row's last position) | slots | rows | table
        acts = torch.empty(2, rows, hidden)  # the residual stream, the output
        self._stack.block_size = bs
        self._stack.kv_bf16 = int(kv_cache.dtype == torch.bfloat16)
        step = 8 * rows
        rc = self._fn(ctypes.byref(self._stack), at, acts.data_ptr(), acts[1].data_ptr(), rows,
                      at + step, at + 2 * step, at + 3 * step, at + step, at + 4 * step, width,
                      kv_cache.data_ptr(), kv_cache.shape[2], head_splits(rows, kv_heads))
        if rc in (-2, -3):
            raise ValueError("the decode stack's rows, token ids, cache slots and blocks "
                             "must lie in range")
        if rc != 0:
            raise MemoryError("the decode stack could not allocate its scratch buffers")
        return acts[1]
