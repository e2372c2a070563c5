"""The native CPU kernels against the torch computations they replace."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.kernels import cpu_features, cpu_kernels
from tandem.engine.model.rope import RotaryEmbedding

kernels = cpu_kernels.load()
# CI sets REQUIRE_CPU_KERNELS=1: there a failed build fails here instead of skipping (the
# engine would otherwise fall back to the torch path without a word in the test results).
if os.environ.get("REQUIRE_CPU_KERNELS") == "1":
    assert kernels is not None, "the native CPU kernels did not build (see the warning logged)"
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")


def _reference_decode(q, k_cache, v_cache, table, positions, window, scale):
    """Gather + masked SDPA: the torch path's decode attention."""
    bs = k_cache.shape[1]
    keys = torch.arange(table.shape[1] * bs)
    mask = keys[None, :] <= positions[:, None]
    if window:
        mask &= keys[None, :] > positions[:, None] - window
    kg = k_cache[table].flatten(1, 2).transpose(1, 2)
    vg = v_cache[table].flatten(1, 2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None], kg, vg, attn_mask=mask[:, None, None],
                                       scale=scale, enable_gqa=True)
    return o[:, :, 0]


# head sizes: 64 and 128 compile to their own code, 32 runs the generic vector path,
# 40 the scalar one; rows past 256 keys are attended in chunks (alone, by several threads)
@pytest.mark.parametrize("heads,kv_heads,rows,window,d,max_pos", [
    (8, 4, 64, None, 32, 90), (4, 4, 3, None, 64, 90), (8, 2, 1, None, 128, 90),
    (16, 4, 5, 20, 64, 90), (6, 2, 40, 7, 40, 90), (9, 3, 7, None, 64, 90),
    (4, 2, 2, None, 128, 90), (9, 3, 1, None, 64, 3000), (8, 4, 6, None, 32, 1500),
    (4, 2, 3, 700, 40, 2000), (8, 2, 1, 300, 128, 1200)])
def test_paged_decode_matches_gather_and_sdpa(heads, kv_heads, rows, window, d, max_pos):
    gen = torch.Generator().manual_seed(rows)
    bs, num_blocks = 8, 3000
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    positions = torch.randint(max_pos // 2, max_pos, (rows,), generator=gen)
    max_blocks = int(positions.max()) // bs + 1
    table = torch.randperm(num_blocks, generator=gen)[:rows * max_blocks].view(rows, max_blocks)
    # q rows strided, as views of a fused qkv output; decode rows scattered in the batch
    qkv = torch.randn(rows + 3, (heads + 2 * kv_heads) * d, generator=gen)
    q = qkv[:, :heads * d].view(rows + 3, heads, d)
    token_rows = torch.randperm(rows + 3, generator=gen)[:rows]
    out = torch.full((rows + 3, heads, d), float("nan"))
    kernels.paged_decode(q, out, token_rows, k_cache, v_cache, table, positions, window, 0.3)
    ref = _reference_decode(q[token_rows], k_cache, v_cache, table, positions, window, 0.3)
    torch.testing.assert_close(out[token_rows], ref, atol=2e-6, rtol=1e-5)
    untouched = torch.ones(rows + 3, dtype=torch.bool)
    untouched[token_rows] = False
    assert out[untouched].isnan().all(), "rows outside the group must not be written"


@pytest.mark.parametrize("d,kv_dtype", [(64, torch.float32), (128, torch.bfloat16), (32, torch.float32),
                                         (40, torch.float32)])
def test_paged_decode_gives_a_row_the_same_bits_in_any_batch(d, kv_dtype, monkeypatch):
    """Alone, a long row's key chunks go to separate tasks, and on a wide team its kv heads
    are split over threads too; in a batch a task takes a whole row: the sums run in the
    same order every way, so a sequence's tokens do not depend on what it is batched with
    or on the threads."""
    gen = torch.Generator().manual_seed(d)
    heads, kv_heads, bs = 8, 4, 16
    rows = 4 * torch.get_num_threads()
    assert cpu_kernels._head_splits(1, kv_heads, 8) == kv_heads, "alone on 8 threads: split"
    assert cpu_kernels._head_splits(1, kv_heads, 2) == 1, "alone on 2: a whole row"
    assert cpu_kernels.head_splits(rows, kv_heads) == 1, "batched, a task is a whole row"
    k_cache = torch.randn(400, bs, kv_heads, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(400, bs, kv_heads, d, generator=gen).to(kv_dtype)
    positions = torch.randint(0, 1200, (rows,), generator=gen)  # 1-5 chunks of keys
    table = torch.randint(0, 400, (rows, 75), generator=gen)
    q = torch.randn(rows, heads, d, generator=gen)
    batched = torch.empty(rows, heads, d)
    kernels.paged_decode(q, batched, torch.arange(rows), k_cache, v_cache, table, positions, None, 0.125)
    threads = torch.get_num_threads()
    for r in range(rows):
        for team, splits in ((threads, 1), (1, 1), (threads, kv_heads)):  # the last as on a wide team
            monkeypatch.setattr(cpu_kernels, "head_splits", lambda rows, kv: splits)
            torch.set_num_threads(team)
            try:
                alone = torch.empty(1, heads, d)
                kernels.paged_decode(q[r:r + 1], alone, torch.zeros(1, dtype=torch.long), k_cache,
                                     v_cache, table[r:r + 1], positions[r:r + 1], None, 0.125)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(alone[0], batched[r]), f"row {r}, {team} threads, {splits} splits"


def test_paged_decode_rejects_wrong_dtypes_and_layouts():
    q = torch.randn(2, 4, 8)
    cache = torch.randn(4, 4, 2, 8)
    args = (torch.arange(2), cache, cache, torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, dtype=torch.long), None, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode(q, torch.empty_like(q), torch.arange(2, dtype=torch.int32),
                             *args[1:])
    with pytest.raises(ValueError, match="fp32"):
        kernels.paged_decode(q.half(), torch.empty_like(q), *args)
    with pytest.raises(ValueError, match="dense heads"):
        kernels.paged_decode(q.transpose(0, 1), torch.empty_like(q), *args)


def test_add_rms_norm_adds_in_place_and_normalizes():
    x, delta, w = torch.randn(37, 96), torch.randn(37, 96), torch.randn(96)
    expected_x = x + delta
    h = expected_x * torch.rsqrt(expected_x.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, expected_x)
    torch.testing.assert_close(out, w * h, atol=1e-6, rtol=1e-5)
    plain = kernels.add_rms_norm(x.clone(), None, w, 1e-5)
    torch.testing.assert_close(plain, out, atol=1e-6, rtol=1e-5)


def test_rope_in_place_is_bit_identical_to_torch():
    rope = RotaryEmbedding(64, 512, 10000.0, None, torch.float32)
    qkv = torch.randn(50, (8 + 2 * 2) * 64)
    positions = torch.randint(0, 512, (50,))
    q, k = qkv[:, :512].view(50, 8, 64), qkv[:, 512:640].view(50, 2, 64)
    ref_q, ref_k = rope(q, k, positions)
    kernels.rope_(q, k, rope.cos, rope.sin, positions)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_store_kv_writes_what_index_copy_of_the_cast_rows_writes(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (6 + 2 * 2) * 32, generator=gen) * 50
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1 + 2 ** -8])  # and a tie
    qkv[0, 200:204] = qkv[-1, 300:304] = specials  # in k and in v
    k, v = qkv[:, 192:256].view(rows, 2, 32), qkv[:, 256:].view(rows, 2, 32)  # strided rows
    slots = torch.randperm(40 * 16, generator=gen)[:rows]
    want_k, want_v = (torch.zeros(40, 16, 2, 32, dtype=dtype) for _ in range(2))
    want_k.view(-1, 2, 32).index_copy_(0, slots, k.to(dtype))
    want_v.view(-1, 2, 32).index_copy_(0, slots, v.to(dtype))
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    kernels.store_kv(k, v, got_k, got_v, slots)
    nan = want_k.isnan()
    assert torch.equal(got_k.isnan(), nan)  # a NaN stays a NaN (its payload may differ)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got_k.view(bits)[~nan], want_k.view(bits)[~nan])
    nan = want_v.isnan()
    assert torch.equal(got_v.isnan(), nan) and nan.any()
    assert torch.equal(got_v.view(bits)[~nan], want_v.view(bits)[~nan])


def test_store_kv_refuses_slots_outside_the_cache_and_shapes_that_do_not_fit():
    k = v = torch.randn(2, 2, 32)
    cache = torch.zeros(4, 16, 2, 32)
    for bad in ([0, 64], [-1, 3]):
        with pytest.raises(ValueError, match="outside the cache"):
            kernels.store_kv(k, v, cache, cache.clone(), torch.tensor(bad))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.store_kv(k, v, torch.zeros(4, 16, 1, 32), torch.zeros(4, 16, 1, 32), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="do not fit"):  # a smaller v cache is not written past its end
        kernels.store_kv(k, v, cache, torch.zeros(2, 16, 2, 32), torch.tensor([0, 40]))
    with pytest.raises(ValueError, match="dense heads"):
        kernels.store_kv(k.transpose(1, 2), v, cache, cache.clone(), torch.tensor([0, 1]))
    assert torch.count_nonzero(cache) == 0


def test_silu_mul_matches_torch_over_a_wide_range():
    gate_up = torch.cat([torch.linspace(-100, 100, 4000).view(40, 100)] * 2, dim=1)
    gate_up[:, 100:] = torch.randn(40, 100)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up,
                               atol=1e-6, rtol=2e-6)


def test_bf16_silu_mul_is_the_fp32_kernel_on_widened_values_rounded_once():
    gate_up = torch.cat([torch.linspace(-100, 100, 4000).view(40, 100), torch.randn(40, 100)],
                        dim=1)
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    gate_up = gate_up.bfloat16()
    out = kernels.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (40, 100)
    wide = kernels.silu_mul(gate_up.float()).to(torch.bfloat16)
    assert torch.equal(out.isnan(), wide.isnan()) and out.isnan().any()
    assert torch.equal(out.nan_to_num(0.0).view(torch.int16), wide.nan_to_num(0.0).view(torch.int16))


def test_silu_mul_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernels.silu_mul(torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.silu_mul(torch.zeros(8, 4).t())


def test_a_bf16_mlp_keeps_its_interior_bf16_with_the_same_result():
    """gate|up's bf16 product into SiLU·mul and on to down unwidened: bit-identical to
    widening it, the fp32 kernel, and down rounding its input (rows past the GEMV)."""
    from tandem.engine.kernels import onednn
    from tandem.engine.model.layer_ops import NativeLayerOps, TorchLayerOps

    if not onednn.available(torch.device("cpu")):
        pytest.skip("no oneDNN linear in this torch")
    if not cpu_features.has_native_bf16():
        pytest.skip("no AVX-512 BF16 / AMX: oneDNN has no bf16 product here (bf16 runs on the torch path)")
    gen = torch.Generator().manual_seed(0)
    # the plain layout: one or two bf16 rows go to the GEMV, and the MLP keeps fp32 there
    gate_up = onednn.CpuLinear(torch.randn(2 * 96, 64, generator=gen) / 8, None, torch.bfloat16,
                               layout="plain")
    down = onednn.CpuLinear(torch.randn(64, 96, generator=gen) / 8, None, torch.bfloat16,
                            layout="plain")
    assert [gate_up.runs_on_onednn(r) for r in (1, 2, 3)] == [False, False, True]
    ops = NativeLayerOps(kernels)
    for rows in (1, 2, 3, 37):
        h = torch.randn(rows, 64, generator=gen)
        widened = down(kernels.silu_mul(gate_up(h)))
        torch.testing.assert_close(TorchLayerOps().mlp(h, gate_up, down), widened,
                                   atol=1e-2, rtol=1e-2)
        calls = []
        product = gate_up.product
        gate_up.product = lambda x: calls.append(1) or product(x)
        out = ops.mlp(h, gate_up, down)
        del gate_up.product
        assert out.dtype == torch.float32 and torch.equal(out, widened)
        assert calls == ([1] if gate_up.runs_on_onednn(rows) else [])


def test_argmax_picks_what_torch_picks_first_maxima_nans_and_infinities():
    x = torch.randn(9, 1000)
    x[1, 3] = x[1, 700] = 50.0  # a tie: the first one
    x[2, 999] = 60.0  # the last element, in the tail past whole vectors
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, 500] = float("nan")  # a NaN wins over a larger value before it
    x[4, 10] = 70.0
    x[5, 20] = x[5, 30] = float("nan")  # the first NaN
    x[6, 17] = float("inf")
    x[7] = 0.0  # all equal
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    for cols in (1, 15, 16, 17, 49_152):
        y = torch.randn(5, cols)
        assert torch.equal(kernels.argmax(y), y.argmax(dim=-1))
    assert kernels.argmax(torch.empty(0, 8)).shape == (0,)


def test_argmax_refuses_what_it_cannot_read():
    for bad in (torch.randn(4, 8).half(), torch.randn(8, 4).t(), torch.randn(8), torch.empty(3, 0)):
        with pytest.raises(ValueError):
            kernels.argmax(bad)


def test_a_failed_build_falls_back_to_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert "torch path" in caplog.text
    finally:
        cpu_kernels.load.cache_clear()


def test_every_kernel_source_is_built_and_keys_the_cache():
    """A source left out of SOURCES is never compiled; a header left out of HEADERS does not
    key the cached library, so editing it would keep loading the old build."""
    from tandem.engine.kernels import kernel_build

    listed = set(kernel_build.SOURCES) | set(kernel_build.HEADERS)
    present = {p.name for p in kernel_build.CSRC.iterdir() if p.suffix in (".c", ".h")}
    assert listed == present
