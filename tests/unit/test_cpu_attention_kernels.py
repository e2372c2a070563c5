"""bf16 KV reads of the native decode kernel and the GEMV against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.kernels import cpu_kernels
from tests.attention_reference import reference_prefill

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("d", [16, 64, 24])
def test_paged_decode_reads_a_bf16_cache(d):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(50, 4, 2, d, generator=gen).bfloat16()
    v_cache = torch.randn(50, 4, 2, d, generator=gen).bfloat16()
    q = torch.randn(3, 4, d, generator=gen)
    table = torch.randperm(50, generator=gen)[:15].view(3, 5)
    positions = torch.tensor([0, 9, 19])
    out = torch.empty_like(q)
    kernels.paged_decode(q, out, torch.arange(3), k_cache, v_cache, table, positions, None, 0.5)
    ref = reference_prefill(q, k_cache, v_cache, table, [0, 1, 2], positions.tolist(), [1, 1, 1],
                             None, 0.5)
    torch.testing.assert_close(out, torch.cat(ref), atol=2e-5, rtol=1e-4)


def test_paged_decode_rejects_mixed_or_unsupported_caches():
    q = torch.randn(2, 4, 8)
    idx = torch.zeros(1, dtype=torch.long)
    table = torch.zeros(1, 1, dtype=torch.long)
    f32, b16 = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8).bfloat16()
    with pytest.raises(ValueError, match="one dtype"):
        kernels.paged_decode(q, torch.empty_like(q), idx, f32, b16, table, idx, None, 1.0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.paged_decode(q, torch.empty_like(q), idx, f32.half(), f32.half(), table, idx, None, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode(q, torch.empty_like(q), idx.int(), f32, f32, table, idx, None, 1.0)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 16])  # whole tiles of 4 rows and a rest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(300, 200, True), (7, 37, False), (1030, 512, False)])
def test_gemv_matches_the_matmul(rows, dtype, n, k, bias):
    """Odd sizes: a tail of fewer than 4 output rows, K not a multiple of 16, one thread's share."""
    gen = torch.Generator().manual_seed(rows * n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(kernels.gemv(x, w, b), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gemv_row_comes_out_bit_identical_alone_and_in_any_batch(dtype):
    """Each output is one vector sum over K then a fixed horizontal sum (AVX-512, or AVX2 +
    FMA), so a row's logits do not depend on the rows decoded beside it."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(301, 203, generator=gen).to(dtype)  # K: whole vectors and a tail
    x = torch.randn(16, 203, generator=gen)
    batch = kernels.gemv(x, w, None)
    for lo, hi in ((0, 1), (5, 6), (3, 6), (2, 9), (15, 16)):
        assert torch.equal(kernels.gemv(x[lo:hi].contiguous(), w, None), batch[lo:hi])


def test_gemv_refuses_what_it_cannot_compute():
    x, w = torch.randn(17, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="1..16 rows"):
        kernels.gemv(x, w, None)
    with pytest.raises(ValueError, match="matching"):
        kernels.gemv(x[:2], w[:, :8].contiguous(), None)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.gemv(x[:2], w.half(), None)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.gemv(x[:2], w.t().contiguous().t(), None)


def test_bench_attention_reports_the_read_rate(capsys):
    from tandem.cli.main import main

    assert main(["bench", "attention", "--rows", "3", "--context", "40", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "64", "--layers", "2", "--repeats", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 rows x 40 tokens, 4/2 heads of 64, 2 layers, float32 KV, 1 threads" in out
    import re

    rate = re.search(r"of K/V at ([\d.]+) GB/s against ([\d.]+) GB/s for a streaming read", out)
    assert rate and float(rate.group(1)) > 0 and float(rate.group(2)) > 0, out
