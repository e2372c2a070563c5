"""Long-lived CPU tensors on transparent huge pages: the weights a decode step streams.

A batch-1 decode step reads every weight once. On 4 KB pages a 160 MB model spans
40,000 pages, many times what the TLB holds, so the stream takes a page walk every
4 KB; on 2 MB pages it takes one every 2 MB. A step's products, and a plain streaming
read, run faster that way (services/RESULTS.md).

Linux backs memory with huge pages where a mapping asks for them (``madvise``
mode, the common default) or always (``always`` mode); torch's allocator does not
ask. ``empty`` carves tensors out of anonymous mappings that do, from a 2 MB boundary,
``CHUNK_BYTES`` at a time (a larger tensor gets a mapping of its own). A mapping lives
as long as any tensor carved from it; its pages are backed when first written, so an
unused tail costs address space only. Where huge pages cannot be had (another OS,
THP ``never``), or with ``TANDEM_HUGE_PAGES=0`` in the environment, ``empty`` is
``torch.empty``. Freed tensors' memory is not reused: a chunk stays mapped while any
tensor from it (or the arena, for its current chunk) lives; weights and caches are
allocated once per engine, so this costs at most a chunk per process.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
CHUNK_BYTES = 64 * 2**20
ALIGN = 256  # bytes between tensors of one chunk: whole cache lines, AVX-512 aligned
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (always | madvise | never), or "" where
    there is none (not Linux, or not readable)."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def available() -> bool:
    """Whether ``empty`` hands out memory that asks for huge pages here (a kernel may still
    refuse the advice: then the pages are ordinary ones)."""
    return os.environ.get("TANDEM_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE") \
        and thp_mode() in ("always", "madvise")


class _Arena:
    """Bump allocation from the current chunk; a full chunk is left to its tensors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None  # uint8 over the 2 MB-aligned part of a mapping
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of fresh (zero) memory as a uint8 tensor, ALIGN-aligned."""
        with self._lock:
            if nbytes > CHUNK_BYTES // 2:
                return _mapping(nbytes)  # its own: it would leave most of a chunk unused
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = _mapping(CHUNK_BYTES), 0
            start = self._used
            self._used = -(-(start + nbytes) // ALIGN) * ALIGN
            return self._chunk[start:start + nbytes]


def _mapping(nbytes: int) -> torch.Tensor:
    """A fresh anonymous mapping that asks for huge pages, as a uint8 tensor of
    ``nbytes`` from its first 2 MB boundary (the tensor keeps the mapping alive)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel (or sandbox) that refuses: ordinary pages, the same memory
        pass
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


_arena = _Arena()


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor, on huge pages where ``available()``."""
    if not available():
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for s in shape:
        numel *= int(s)
    item = torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return _arena.take(numel * item).view(dtype).view(shape)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed contiguous CPU tensor, on huge pages where ``available()``; its pages are
    backed now (written), not on first use in a step."""
    return empty(shape, dtype).zero_()


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) contiguous, copied onto huge pages where ``available()``; else
    ``t.contiguous()`` (no copy when it already is)."""
    if not available():
        return t.contiguous()
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out
