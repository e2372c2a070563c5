"""bf16 linears on AMX tiles (where the CPU has AMX-BF16) against the bf16 product they
stand for: x rounded to bf16, fp32 sums, bias added, each output rounded to bf16."""

from __future__ import annotations

import pytest
import torch

from services.engine.model import amx_linear, onednn
from services.engine.model.onednn import AMX, CpuLinear

kernels = amx_linear.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no AMX-BF16 on this machine")


def _reference(x, w, b):
    y = x.bfloat16().double() @ w.double().T + (0 if b is None else b.double())
    return y.bfloat16().float()


@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (48, 64), (576, 1536), (5, 31)])
@pytest.mark.parametrize("m", [1, 5, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_bf16_product_within_its_rounding(n, k, m, bias):
    gen = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    got = kernels.linear(x, kernels.pack(w), b, n)
    ref = _reference(x, w, b)
    # fp32 sums in another order than the float64 reference: at most one bf16 step apart
    step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    assert ((got - ref).abs() <= step).all()
    assert (got == ref).float().mean() > 0.9
    assert torch.equal(got, got.bfloat16().float())  # every output a bf16 value


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 96, generator=gen).bfloat16(), torch.randn(200, generator=gen)
    packed = kernels.pack(w)
    x = torch.randn(70, 96, generator=gen)
    batch = kernels.linear(x, packed, b, 200)
    for r in (0, 31, 32, 69):
        assert torch.equal(kernels.linear(x[r:r + 1].clone(), packed, b, 200)[0], batch[r])
    assert kernels.linear(x[:0], packed, b, 200).shape == (0, 200)


def test_it_refuses_what_it_cannot_compute():
    w = torch.randn(48, 64).bfloat16()
    with pytest.raises(ValueError, match="bf16 CPU weights"):
        kernels.pack(w.float())
    packed = kernels.pack(w)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(torch.randn(2, 65), packed, None, 48)
    with pytest.raises(ValueError, match="fp32"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed, None, 48)


def test_a_bf16_cpu_linear_asked_to_be_packed_takes_the_amx_layout():
    w, b = torch.randn(100, 64), torch.randn(100)
    assert onednn.storage_layout("packed", torch.bfloat16, True) == AMX
    assert onednn.storage_layout("packed", torch.bfloat16, False) == "blocked"  # no native kernels
    assert onednn.storage_layout("blocked", torch.bfloat16, True) == "blocked"
    lin = CpuLinear(w, b, torch.bfloat16, True, "packed")
    blocked = CpuLinear(w, b, torch.bfloat16, True, "blocked")
    assert lin.layout == AMX and not lin.runs_on_onednn(1 << 20)
    x = torch.randn(3, 7, 64)
    got, ref = lin(x), blocked(x)
    assert got.shape == ref.shape == (3, 7, 100) and got.dtype == torch.float32
    step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    assert ((got - ref).abs() <= step).all()
