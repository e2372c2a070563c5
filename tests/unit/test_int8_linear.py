"""Weight-only int8 linears: the packed int8 kernel against the dequantized product, and
a row's bits alone and in any batch (decode rows widen each panel as they read it,
blocks of prompt rows widen it once: the same sums)."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.kernels import quantized
from tandem.engine.kernels.quantized import Int8Linear
from tests.native_build import build_for

kernels = quantized.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")


def _layer(n: int, k: int, bias: bool, seed: int) -> Int8Linear:
    gen = torch.Generator().manual_seed(seed)
    return Int8Linear(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None)


@needs_kernel
@pytest.mark.parametrize("n,k,bias", [(300, 200, True), (37, 33, False), (1030, 576, True), (5, 7, False)])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 23, 24, 40, 200])  # tiles of 12; blocks of 24+ widen
def test_the_kernel_computes_the_dequantized_product(n, k, bias, rows):
    lin = _layer(n, k, bias, n + rows)
    assert lin.qweight.shape == ((n + 31) // 32, k, 32)  # packed
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = F.linear(x.double(), lin.dequantized().double(), None if lin.bias is None else lin.bias.double())
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    lin = _layer(300, 200, True, 1)
    x = torch.randn(200, 200, generator=torch.Generator().manual_seed(2))
    batch = lin(x)
    for rows in (1, 7, 23, 24, 169):  # on-the-fly and widened panels, one block and two
        assert torch.equal(lin(x[:rows]), batch[:rows]), rows
    assert lin(x[:0]).shape == (0, 300)


@needs_kernel
def test_the_packed_weight_dequantizes_to_the_quantized_rows():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(70, 40, generator=gen)
    q, scale = quantized.quantize_rows(w)
    lin = Int8Linear(w, None)
    assert torch.equal(lin.dequantized(), q.float() * scale[:, None])
    assert (lin.dequantized() - w).abs().max() <= scale.max() / 2 + 1e-6  # within half a step


@needs_kernel
def test_it_refuses_what_it_cannot_compute():
    q, scale = quantized.quantize_rows(torch.randn(48, 64))
    packed = kernels.pack(q)
    with pytest.raises(ValueError, match="int8 CPU weights"):
        kernels.pack(q.float())
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(torch.randn(2, 65), packed, scale, None, 48)
    with pytest.raises(ValueError, match="fp32"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed, scale, None, 48)


def test_without_the_kernels_each_call_dequantizes(monkeypatch):
    monkeypatch.setattr(quantized, "load", lambda: None)
    lin = _layer(64, 48, True, 5)
    assert lin.kernels is None and lin.qweight.shape == (64, 48)
    x = torch.randn(3, 48)
    torch.testing.assert_close(lin(x), F.linear(x, lin.dequantized(), lin.bias))


@needs_kernel
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_the_other_builds_compute_the_same_bits(tmp_path, march):
    """Built for AVX2 + FMA (x86-64-v3: its own tiles) or without FMA (x86-64-v2: the
    portable loop, fmaf) the products are this CPU's build's, bit for bit: every build
    runs each output's same chain of fused multiply-adds."""
    other = quantized.Int8Kernels(build_for(tmp_path, march, ("int8_linear.c",)))  # type: ignore[arg-type]
    q, scale = quantized.quantize_rows(torch.randn(161, 70, generator=torch.Generator().manual_seed(6)))
    bias = torch.randn(161)
    packed = kernels.pack(q)
    assert torch.equal(other.pack(q), packed)
    for rows in (1, 2, 3, 30, 130):  # widened as read, then blocks that widen once
        x = torch.randn(rows, 70, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(other.linear(x, packed, scale, bias, 161), kernels.linear(x, packed, scale, bias, 161))
        assert torch.equal(other.linear(x, packed, scale, None, 161), kernels.linear(x, packed, scale, None, 161))
