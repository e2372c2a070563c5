"""The packed fp32 linear (csrc/packed_linear.c): the product of the plain weight for
every row count and shape edge, each row's result independent of its batch, on this
CPU's build and on the AVX2 and portable ones; the gate|up product fused with SiLU·mul; and
the embedding lookup in a packed (tied) head."""

from __future__ import annotations

import platform

import pytest
import torch

from tandem.engine.kernels import packed_linear
from tests.native_build import build_for

pytestmark = pytest.mark.skipif(packed_linear.load() is None,
                                reason="no C compiler, or no AVX-512 or AVX2 + FMA on this machine")

# (N, K): panels full, partial, one; from 128 rows on, pairs of panels (an odd one left per
# thread; the pair's second panel partial)
SHAPES = [(1, 1), (31, 17), (32, 64), (33, 5), (100, 576), (96, 24), (161, 40)]
ROWS = [1, 2, 6, 7, 13, 14, 15, 29, 127, 128, 168, 200, 301]  # tiles of 14 and 6 rows (AVX2: 3 and 6), blocks of 168


def _case(n: int, k: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    return w, b, gen


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_it_computes_the_plain_product_for_every_row_count(n, k, bias):
    kernels = packed_linear.load()
    w, b, gen = _case(n, k, bias)
    packed = kernels.pack(w)
    assert packed.shape == ((n + 31) // 32, k, 32)
    assert torch.equal(packed.permute(0, 2, 1).reshape(-1, k)[:n], w)  # panels of 32 rows, K-major
    assert not packed.permute(0, 2, 1).reshape(-1, k)[n:].any()  # the last panel zero-padded
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        want = x @ w.T + (0 if b is None else b)
        torch.testing.assert_close(kernels.linear(x, packed, b, n), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k", [(100, 576), (161, 40)])
def test_a_row_comes_out_bit_identical_alone_and_in_any_batch(n, k):
    """In a batch of up to 127 rows a row takes the one-panel micro-kernel (up to 8 rows
    without software prefetch), from 128 on the two-panel one."""
    kernels = packed_linear.load()
    w, b, gen = _case(n, k, bias=True)
    packed = kernels.pack(w)
    x = torch.randn(200, k, generator=gen)
    batch = kernels.linear(x, packed, b, n)
    for i in (0, 5, 6, 13, 14, 167, 168, 199):  # first/last of a micro-tile and of a block
        assert torch.equal(kernels.linear(x[i:i + 1].contiguous(), packed, b, n)[0], batch[i])
    for lo, hi in ((20, 26), (20, 27), (20, 50)):
        assert torch.equal(kernels.linear(x[lo:hi].contiguous(), packed, b, n), batch[lo:hi])
    assert torch.equal(kernels.linear(x[:130].contiguous(), packed, b, n), batch[:130])


def test_it_refuses_what_does_not_fit():
    kernels = packed_linear.load()
    w, b, gen = _case(40, 16, bias=True)
    packed = kernels.pack(w)
    x = torch.randn(3, 16, generator=gen)
    assert kernels.linear(x[:0], packed, b, 40).shape == (0, 40)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(torch.randn(3, 15), packed, b, 40)  # K differs
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(x, packed, b, 65)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(x, packed, b, 32)  # a whole panel unused
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(x, packed, b[:39], 40)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernels.linear(x.double(), packed, b, 40)
    with pytest.raises(ValueError, match="fp32 CPU weights"):
        kernels.pack(w.bfloat16())


@pytest.mark.parametrize("vocab", [1, 32, 100])
def test_an_embedding_reads_the_plain_tables_rows_from_the_packed_weight(vocab):
    table = torch.randn(vocab, 24, generator=torch.Generator().manual_seed(vocab))
    embed = packed_linear.PackedEmbedding(packed_linear.load().pack(table), vocab)
    every = torch.arange(vocab)
    assert torch.equal(embed(every), table)
    ids = torch.randint(0, vocab, (3, 5))
    assert torch.equal(embed(ids), table[ids])  # [B, T] -> [B, T, K]
    assert embed(every[:0]).shape == (0, 24)
    for bad in (vocab, -1):  # the padded panel's columns are not rows
        with pytest.raises(IndexError, match=f"in \\[0, {vocab}\\)"):
            embed(torch.tensor([0, bad]))
    with pytest.raises(ValueError, match="packed table"):
        packed_linear.PackedEmbedding(packed_linear.load().pack(table), vocab + 32)


def _build(tmp_path, march: str) -> packed_linear.PackedKernels:
    """packed_linear.c alone, compiled for ``march`` instead of this CPU."""
    return packed_linear.PackedKernels(build_for(tmp_path, march, ("packed_linear.c",)))  # type: ignore[arg-type]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds")
@pytest.mark.parametrize("march,exact", [("x86-64-v3", True), ("x86-64-v2", False)])
def test_the_other_builds_compute_the_same(tmp_path, march, exact):
    """Built for AVX2 + FMA (x86-64-v3: the AVX2 micro-kernel) the products are bit-identical
    to this CPU's build (AVX-512 or AVX2: the same FMA chain per output); built without FMA
    (x86-64-v2: the portable loop) within rounding. Rows stay independent of their batch."""
    other, native = _build(tmp_path, march), packed_linear.load()
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    w, b, gen = _case(161, 70, bias=True)
    packed = native.pack(w)
    assert torch.equal(other.pack(w), packed)
    for rows in (1, 4, 30, 130):  # the native build: one panel at a time, then pairs
        x = torch.randn(rows, 70, generator=gen)
        batch = other.linear(x, packed, b, 161)
        assert same(batch, native.linear(x, packed, b, 161)), rows
        assert torch.equal(other.linear(x[rows // 2:rows // 2 + 1].contiguous(), packed, b, 161)[0],
                           batch[rows // 2])
    assert same(other.linear(x, packed, None, 161), native.linear(x, packed, None, 161))
    from tandem.engine.kernels import cpu_kernels

    w, b, gen = _case(128, 70, bias=True)  # gate|up of 64 channels each
    packed = native.pack(w)
    for rows in (3, 130):
        x = torch.randn(rows, 70, generator=gen)
        want = cpu_kernels.load().silu_mul(other.linear(x, packed, b, 128))
        assert torch.equal(other.gate_up_silu(x, packed, b, 128), want)


@pytest.mark.parametrize("inter,k", [(32, 17), (160, 64), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_gate_up_silu_is_bit_identical_to_the_product_then_silu_mul(inter, k, bias):
    from tandem.engine.kernels import cpu_kernels

    kernels, native = packed_linear.load(), cpu_kernels.load()
    w, b, gen = _case(2 * inter, k, bias)
    packed = kernels.pack(w)
    for rows in (1, 5, 6, 7, 14, 127, 128, 169, 301):
        x = torch.randn(rows, k, generator=gen)
        want = native.silu_mul(kernels.linear(x, packed, b, 2 * inter))
        assert torch.equal(kernels.gate_up_silu(x, packed, b, 2 * inter), want), rows
    assert kernels.gate_up_silu(x[:0], packed, b, 2 * inter).shape == (0, inter)
    with pytest.raises(ValueError, match="whole pairs of panels"):
        kernels.gate_up_silu(x, kernels.pack(w[:2 * inter - 32]), None, 2 * inter - 32)
