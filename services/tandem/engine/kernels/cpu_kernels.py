"""Native CPU kernels (C with OpenMP), compiled on first use and called through ctypes.

The C sources in ``csrc/`` are built once per machine (``kernel_build.py``). The
library links the OpenMP runtime torch has already loaded, so kernels share torch's
threads.

``load()`` returns None, after one warning, when no compiler is found or the
build fails; callers then keep the torch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from functools import cache

import torch

from tandem.engine.kernels import kernel_build

log = logging.getLogger(__name__)

_KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
GEMV_MAX_ROWS = 16  # TANDEM_GEMV_MAX_ROWS in csrc/kernels.h


class CpuKernels:
    """The loaded library; each method checks its tensors before handing pointers over."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib  # for entries bound where they are used (decode_stack.py)
        self._decode = {}
        for dtype, suffix in _KV_DTYPES.items():
            fn = getattr(lib, f"tandem_paged_decode_{suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
                           _i64, _i64, _i64, _i64, _i64, _f32, _i64]
            self._decode[dtype] = fn
        self._prefill = {}
        for dtype, suffix in _KV_DTYPES.items():
            fn = getattr(lib, f"tandem_paged_prefill_{suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64,
                           _i64, _i64, _i64, _i64, _i64, _f32]
            self._prefill[dtype] = fn
        self._prefill_amx = bind(lib, "tandem_paged_prefill_amx", ctypes.c_int,
                                 *self._prefill[torch.bfloat16].argtypes)
        self._prefill_supported = bind(lib, "tandem_paged_prefill_supported", ctypes.c_int, _i64)
        self._prefill_amx_supported = bind(lib, "tandem_paged_prefill_amx_supported",
                                           ctypes.c_int, _i64)
        self._prefill_heads: dict[tuple[int, bool], bool] = {}
        self._gemv = {}
        for dtype, suffix in _KV_DTYPES.items():
            fn = getattr(lib, f"tandem_gemv_{suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
            self._gemv[dtype] = fn
        self._add_rms_norm = lib.tandem_add_rms_norm_f32
        self._add_rms_norm.restype = None
        self._add_rms_norm.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32]
        self._rope = lib.tandem_rope_f32
        self._rope.restype = None
        self._rope.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64]
        self._store_kv = bind(lib, "tandem_store_kv", ctypes.c_int, _ptr, _i64, _ptr, _i64, _i64,
                              _i64, _ptr, _i64, _ptr, _ptr, ctypes.c_int)
        self._silu_mul = {}
        for dtype, name in _KV_DTYPES.items():
            fn = self._silu_mul[dtype] = getattr(lib, f"tandem_silu_mul_{name}")
            fn.restype = None
            fn.argtypes = [_ptr, _ptr, _i64, _i64]
        self._argmax = lib.tandem_argmax_f32
        self._argmax.restype = None
        self._argmax.argtypes = [_ptr, _i64, _i64, _ptr]
        self._inverse_cdf = lib.tandem_inverse_cdf_f32
        self._inverse_cdf.restype = None
        self._inverse_cdf.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place (when given), then return ``RMSNorm(x) * weight``.

        ``x, delta [T, dim]`` contiguous fp32; ``weight [dim]``.
        """
        _check_f32(x, weight, *(() if delta is None else (delta,)))
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                           out.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def rope_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor) -> None:
        """Rotate-half RoPE in place on ``q [T, H, D]`` and ``k [T, KVH, D]``.

        Rows may be strided (views of the fused qkv output); heads must be dense.
        ``cos, sin [P, D]`` fp32 tables; ``positions [T]`` int64.
        """
        _check_dense_heads(q, k)
        _check_f32(cos, sin)
        if positions.dtype != torch.long or not positions.is_contiguous():
            raise ValueError("rope_ positions must be contiguous int64")
        self._rope(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
                   cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), q.shape[0], q.shape[2])

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Row ``t`` of ``k, v [T, KVH, D]`` (fp32, rows may be strided) into slot ``slots[t]``
        of ``k_cache, v_cache [blocks, block_size, KVH, D]``, rounded to bf16 as torch rounds
        for a bf16 cache: what ``index_copy_`` of ``k.to(cache dtype)`` writes (a NaN's payload
        aside), in one pass. Slots are distinct; one outside the cache (a negative one too)
        is refused before anything is written."""
        _check_dense_heads(k, v)
        _check_kv(k_cache, v_cache)
        _check_indices(slots)
        rows, kv_heads, head_dim = k.shape
        if v.shape != k.shape or v_cache.shape != k_cache.shape \
                or k_cache.shape[2:] != (kv_heads, head_dim) or slots.shape != (rows,):
            raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, caches "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}, "
                             f"{tuple(slots.shape)} slots do not fit")
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if self._store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), rows,
                          kv_heads * head_dim, slots.data_ptr(), num_slots, k_cache.data_ptr(),
                          v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16)) != 0:
            raise ValueError(f"store_kv: a slot outside the cache's {num_slots}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused ``[T, 2I]`` projection, as ``[T, I]``, fp32 or
        bf16 (computed in fp32, rounded to bf16 once)."""
        fn = self._silu_mul.get(gate_up.dtype)
        if fn is None or gate_up.dim() != 2 or not gate_up.is_contiguous() \
                or gate_up.device.type != "cpu":
            raise ValueError(f"silu_mul needs a contiguous [T, 2I] fp32 or bf16 CPU tensor, "
                             f"not {gate_up.dtype} {tuple(gate_up.shape)}")
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def paged_decode(self, q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     positions: torch.Tensor, window: int | None, scale: float) -> None:
        """Attend one query per row over its paged keys, writing ``out[rows]``.

        ``q [T, H, D]`` fp32 (rows may be strided), ``out [T, H, D]`` fp32;
        ``rows, positions [R]`` int64 (token row, query position);
        ``k_cache, v_cache [blocks, block_size, KVH, D]`` fp32 or bf16;
        ``block_table [R, max_blocks]`` int64. Keys ``(pos - window, pos]`` when
        ``window`` is set, else ``[0, pos]``.
        """
        _check_f32(out)
        _check_kv(k_cache, v_cache)
        _check_dense_heads(q)
        _check_indices(rows, block_table, positions)
        _, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        rc = self._decode[k_cache.dtype](q.data_ptr(), q.stride(0), out.data_ptr(), rows.data_ptr(),
                          k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), block_table.shape[1],
                          positions.data_ptr(), rows.shape[0], heads, kv_heads, head_dim,
                          block_size, window or 0, scale,
                          head_splits(rows.shape[0], kv_heads))
        if rc != 0:
            raise MemoryError("paged_decode could not allocate its scratch buffers")

    def prefill_supported(self, head_dim: int, amx: bool = False) -> bool:
        """Whether ``paged_prefill`` runs here: AVX-512 and a head size a multiple of 16, or
        AVX2 + FMA and a multiple of 8; with ``amx``, AMX-BF16 tiles (granted to this
        process) and a multiple of 32 up to 256."""
        known = self._prefill_heads.get((head_dim, amx))
        if known is None:
            check = self._prefill_amx_supported if amx else self._prefill_supported
            known = self._prefill_heads[(head_dim, amx)] = bool(check(head_dim))
        return known

    def paged_prefill(self, q: torch.Tensor, out: torch.Tensor, first_rows: torch.Tensor,
                      first_positions: torch.Tensor, num_queries: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      window: int | None, scale: float, amx: bool = False) -> None:
        """Causal attention of prompt chunks over their paged keys, writing ``out``.

        Sequence ``b`` has ``num_queries[b]`` queries at token rows ``first_rows[b] ..``
        and positions ``first_positions[b] ..``; a query at position ``p`` attends keys
        ``(p - window, p]`` when ``window`` is set, else ``[0, p]``.
        ``q [T, H, D]`` fp32 (rows may be strided), ``out [T, H, D]`` fp32;
        ``first_rows, first_positions, num_queries [B]`` int64;
        ``k_cache, v_cache [blocks, block_size, KVH, D]`` fp32 or bf16;
        ``block_table [B, max_blocks]`` int64. Needs ``prefill_supported(D)``.
        ``amx``: a bf16 cache, its products on AMX tiles (queries and probabilities rounded to
        bf16 for them, as torch's bf16 SDPA does); needs ``prefill_supported(D, amx=True)``.
        """
        _check_f32(out)
        _check_kv(k_cache, v_cache)
        _check_dense_heads(q)
        _check_indices(first_rows, first_positions, num_queries, block_table)
        _, heads, head_dim = q.shape
        _, block_size, kv_heads, cache_dim = k_cache.shape
        if out.shape != q.shape or cache_dim != head_dim or heads % kv_heads:
            raise ValueError("paged_prefill needs out shaped as q [T, H, D] and caches of D, "
                             "with H a multiple of the caches' KVH")
        if not first_rows.shape == first_positions.shape == num_queries.shape \
                == block_table.shape[:1]:
            raise ValueError("paged_prefill needs one first row, position, count and table row "
                             "per sequence")
        if amx and k_cache.dtype != torch.bfloat16:
            raise ValueError("paged_prefill on AMX needs a bf16 cache")
        if not self.prefill_supported(head_dim, amx):
            raise ValueError(f"paged_prefill{' on AMX' if amx else ''} does not run head size "
                             f"{head_dim} on this CPU")
        rc = (self._prefill_amx if amx else self._prefill[k_cache.dtype])(
            q.data_ptr(), q.stride(0), out.data_ptr(), first_rows.data_ptr(),
            first_positions.data_ptr(), num_queries.data_ptr(), num_queries.shape[0],
            k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), block_table.shape[1],
            heads, kv_heads, head_dim, block_size, window or 0, scale)
        if rc != 0:
            raise MemoryError("paged_prefill could not allocate its scratch buffers")

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [M, K] @ weight [N, K].T + bias [N]`` for ``M <= GEMV_MAX_ROWS``, fp32 ``[M, N]``.

        ``x`` and ``bias`` fp32, ``weight`` contiguous fp32 or bf16.
        """
        _check_f32(x, *(() if bias is None else (bias,)))
        if weight.dtype not in self._gemv or not weight.is_contiguous() or weight.dim() != 2:
            raise ValueError("gemv needs a contiguous fp32 or bf16 [N, K] weight")
        if not 1 <= x.shape[0] <= GEMV_MAX_ROWS or weight.shape[1] != x.shape[1]:
            raise ValueError(f"gemv needs 1..{GEMV_MAX_ROWS} rows of x [M, K] matching weight [N, K]")
        out = x.new_empty(x.shape[0], weight.shape[0])
        self._gemv[weight.dtype](x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                   out.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1])
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, V]`` fp32 -> ``[R]`` int64: each row's first maximal value, or its first
        NaN (what ``x.argmax(dim=-1)`` returns)."""
        _check_f32(x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax needs fp32 rows [R, V] with V >= 1, not {tuple(x.shape)}")
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def inverse_cdf(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``probs [R, V]`` fp32 (rows need not sum to 1), ``u [R]`` float64 in [0, 1) ->
        ``[R]`` int64: per row the first token whose float64 cumulative mass exceeds
        ``u * total`` (``sampler.draw_from``'s draw, bit for bit), or -1 where the total
        is not finite and positive."""
        _check_f32(probs)
        if probs.dim() != 2 or probs.shape[1] == 0 or u.shape != (probs.shape[0],) \
                or u.dtype != torch.float64 or not u.is_contiguous() or u.device.type != "cpu":
            raise ValueError(f"inverse_cdf needs fp32 rows [R, V] and float64 u [R], not "
                             f"{tuple(probs.shape)} and {u.dtype} {tuple(u.shape)}")
        out = torch.empty(probs.shape[0], dtype=torch.long)
        self._inverse_cdf(probs.data_ptr(), probs.shape[0], probs.shape[1], u.data_ptr(),
                          out.data_ptr())
        return out


def bind(lib: ctypes.CDLL, name: str, restype, *argtypes) -> ctypes._CFuncPtr:
    """The library's entry ``name`` with its result and argument types set."""
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def _check_f32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("CPU kernels need contiguous fp32 CPU tensors")


def _check_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for t in (k_cache, v_cache):
        if t.dtype not in _KV_DTYPES or t.dtype != k_cache.dtype or t.device.type != "cpu" \
                or not t.is_contiguous() or t.dim() != 4:
            raise ValueError("CPU attention needs contiguous fp32 or bf16 CPU KV caches "
                             "[blocks, block_size, KVH, D] of one dtype")


def _check_indices(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.long or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("CPU attention indices must be contiguous int64 CPU tensors")


def _check_dense_heads(*tensors: torch.Tensor) -> None:
    """``[T, heads, D]`` fp32 CPU views whose heads are dense (rows may be strided)."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3 \
                or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError("CPU kernels need fp32 CPU [T, heads, D] tensors with dense heads")


def head_splits(num_rows: int, kv_heads: int) -> int:
    """Pieces each row's kv heads are split into for decode attention. A whole row per task
    reads each K/V block front to back; a task of some of a row's heads reads a slice of
    every key, and one thread reading whole rows beat two or three threads reading slices
    of them, at one row and at a few (services/RESULTS.md). So heads are split only where
    whole rows would leave most threads idle (fewer rows than half the threads), into the
    fewest pieces
    that give each thread a task. (A long row's keys are split too, in chunks the kernel
    chooses from the row's length alone: see KEY_CHUNK in ``csrc/paged_decode.c``.)"""
    return _head_splits(num_rows, kv_heads, torch.get_num_threads())


@cache
def _head_splits(num_rows: int, kv_heads: int, threads: int) -> int:
    if 2 * num_rows >= threads:
        return 1
    return next(s for s in range(1, kv_heads + 1)
                if kv_heads % s == 0 and (num_rows * s >= threads or s == kv_heads))


@cache
def load() -> CpuKernels | None:
    """The compiled kernels, or None (with one warning) where they cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU attention stays on the torch path")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(kernel_build.build(compiler))))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU kernels unavailable, using the torch path: %s", detail)
        return None


def load_for(device: torch.device | str, enabled: bool = True) -> CpuKernels | None:
    """The kernels for an engine on ``device`` with CPU kernels ``enabled``, else None."""
    return load() if enabled and torch.device(device).type == "cpu" else None
