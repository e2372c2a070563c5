"""Weights and the KV cache on transparent huge pages: where the kernel offers them, the
tensors live in mappings that asked for them; elsewhere plain torch tensors."""

from __future__ import annotations

import gc

import pytest
import torch

from tandem.engine import huge_pages
from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.engine.kernels import packed_linear
from tandem.engine.kernels.onednn import CpuLinear

needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason="no transparent huge pages on this host")


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first byte may be backed by huge pages
    (``THPeligible`` of its entry in /proc/self/smaps)."""
    ptr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@needs_thp
def test_tensors_come_aligned_from_mappings_that_ask_for_huge_pages() -> None:
    a = huge_pages.empty((3, 5), torch.float32)
    b = huge_pages.empty((1000,), torch.bfloat16)
    for t in (a, b):
        assert t.is_contiguous() and t.data_ptr() % huge_pages.ALIGN == 0 and thp_eligible(t)
    assert a.shape == (3, 5) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1).all()) and bool((b == 2).all())  # no overlap


@needs_thp
def test_a_tensor_keeps_its_mapping_after_the_arena_moved_on() -> None:
    first = huge_pages.zeros((1024,))
    first.fill_(7.0)
    for _ in range(3):  # fills and leaves behind the current chunk
        huge_pages.empty((huge_pages.CHUNK_BYTES // 4 // 3,))
    gc.collect()
    assert bool((first == 7).all())
    big = huge_pages.zeros((huge_pages.CHUNK_BYTES,), torch.uint8)  # a mapping of its own
    assert thp_eligible(big) and not bool(big.any())


def test_zeros_are_zero_and_copies_equal() -> None:
    z = huge_pages.zeros((4, 300), torch.float64)
    assert z.dtype == torch.float64 and not bool(z.any())
    src = torch.randn(7, 9)
    c = huge_pages.copy_of(src)
    assert torch.equal(c, src) and (c.data_ptr() != src.data_ptr()) == huge_pages.available()
    assert huge_pages.empty((0, 3)).shape == (0, 3)


def test_switched_off_or_unavailable_gives_plain_tensors(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    assert not huge_pages.available()
    assert huge_pages.empty((2, 2)).shape == (2, 2)
    monkeypatch.delenv("TANDEM_HUGE_PAGES")
    mode = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    mode.write_text("always madvise [never]\n")
    assert huge_pages.thp_mode() == "never" and not huge_pages.available()
    mode.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode() == "madvise"
    mode.unlink()
    assert huge_pages.thp_mode() == "" and not huge_pages.available()


@needs_thp
def test_packed_weights_and_the_cpu_kv_cache_are_on_huge_pages() -> None:
    if packed_linear.load() is None:
        pytest.skip("no packed kernel on this CPU")
    lin = CpuLinear(torch.randn(96, 64), None, layout="packed")
    assert lin.layout == "packed" and thp_eligible(lin.weight)
    cache = PagedKVCache(2, 8, 16, 2, 64, torch.float32, torch.device("cpu"))
    assert thp_eligible(cache.kv) and not bool(cache.kv.any())


def test_a_kernel_that_refuses_the_advice_still_gets_its_memory(monkeypatch) -> None:
    import mmap
    import types

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    fake = types.SimpleNamespace(mmap=Refusing, MAP_PRIVATE=mmap.MAP_PRIVATE,
                                 MAP_ANONYMOUS=mmap.MAP_ANONYMOUS, MADV_HUGEPAGE=14)
    monkeypatch.setattr(huge_pages, "mmap", fake)
    t = huge_pages._mapping(3 * 2**20).view(torch.float32)
    t.fill_(2.0)
    assert t.numel() == 3 * 2**20 // 4 and bool((t == 2).all())
