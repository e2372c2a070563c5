"""The native prefill attention kernels against gather + masked SDPA: prompt chunks of
several sequences in one call (their own starts, lengths and scattered blocks), causal
and sliding-window masks, grouped and plain heads, fp32 and bf16 caches (and the AMX
kernel over bf16 caches, where the CPU has AMX), and the attention backend choosing
them for prompt groups."""

from __future__ import annotations

import ctypes
import platform
import re
import shutil

import pytest
import torch

from tandem.engine.kernels import cpu_kernels, kernel_build
from tandem.engine.model.attention import AttentionGroup, AttentionMetadata, TorchPagedAttention
from tests.attention_reference import reference_prefill

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler on this machine")
needs_kernel = pytest.mark.skipif(kernels is None or not kernels.prefill_supported(64),
                                  reason="no AVX-512 or AVX2 + FMA on this machine")
has_amx_kernel = kernels is not None and kernels.prefill_supported(64, amx=True)
needs_amx = pytest.mark.skipif(not has_amx_kernel, reason="no AMX-BF16 on this machine")


def _case(heads, kv_heads, d, dtype, block_size, starts, lens, seed=0):
    """A fused qkv batch (q a strided view), caches and a scattered block table."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(s + n) // block_size) for s, n in zip(starts, lens))
    num_blocks = len(starts) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:len(starts) * max_blocks]
    table = table.view(len(starts), max_blocks).contiguous()
    rows = sum(lens) + 2  # two rows of other tokens, left alone
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    q = qkv[:, :heads * d].view(rows, heads, d)
    first_rows = torch.tensor([1 + sum(lens[:i]) for i in range(len(lens))])
    return q, k_cache, v_cache, table, first_rows


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (8, 2, 80), (8, 1, 32),
                                              (6, 2, 16), (6, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 23, 100])
def test_paged_prefill_matches_gather_and_sdpa(heads, kv_heads, d, dtype, window):
    _check_against_reference(kernels, heads, kv_heads, d, dtype, window)


def _check_against_reference(kern, heads, kv_heads, d, dtype, window):
    """``kern``'s prefill of whole prompts and later chunks against gather + SDPA; the rows
    around them left alone."""
    starts, lens = [0, 37, 5, 0], [150, 64, 1, 17]
    q, k_cache, v_cache, table, first_rows = _case(heads, kv_heads, d, dtype, 16, starts, lens)
    out = torch.full_like(q, float("nan"))
    kern.paged_prefill(q, out, first_rows, torch.tensor(starts), torch.tensor(lens),
                       k_cache, v_cache, table, window, d ** -0.5)
    ref = reference_prefill(q, k_cache, v_cache, table, first_rows.tolist(), starts, lens,
                            window, d ** -0.5)
    torch.testing.assert_close(out[1:-1], torch.cat(ref), atol=2e-5, rtol=1e-4)
    assert out[0].isnan().all() and out[-1].isnan().all()


@pytest.fixture(scope="module")
def avx2(tmp_path_factory) -> cpu_kernels.CpuKernels:
    """Every kernel source compiled for AVX2 + FMA (x86-64-v3) instead of this CPU."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    lib_path = kernel_build.compile_to(compiler, tmp_path_factory.mktemp("build") / "v3.so", "x86-64-v3")
    return cpu_kernels.CpuKernels(ctypes.CDLL(str(lib_path)))


@pytest.mark.skipif(kernels is None or platform.machine() != "x86_64", reason="x86-64 builds")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_matches_gather_and_sdpa(avx2, dtype):
    """Built for AVX2 + FMA (x86-64-v3: vectors of 8 lanes) the kernel matches the reference
    as this CPU's build does, so a host with AVX-512 checks the AVX2 path too."""
    assert avx2.prefill_supported(40) and not avx2.prefill_supported(36)
    assert not avx2.prefill_supported(64, amx=True)  # no AMX in x86-64-v3: the stub says so
    for heads, kv_heads, d in [(9, 3, 64), (8, 2, 40), (4, 4, 8)]:
        for window in (None, 23):
            _check_against_reference(avx2, heads, kv_heads, d, dtype, window)


@needs_kernel
def test_paged_prefill_with_odd_block_sizes_and_long_chunks():
    """Key tiles that cross blocks of 5, a chunk far into its sequence, several query tiles."""
    starts, lens = [300, 0], [200, 333]
    q, k_cache, v_cache, table, first_rows = _case(6, 2, 64, torch.float32, 5, starts, lens,
                                                   seed=4)
    out = torch.empty_like(q)
    kernels.paged_prefill(q, out, first_rows, torch.tensor(starts), torch.tensor(lens),
                          k_cache, v_cache, table, None, 0.3)
    ref = reference_prefill(q, k_cache, v_cache, table, first_rows.tolist(), starts, lens,
                             None, 0.3)
    torch.testing.assert_close(out[1:-1], torch.cat(ref), atol=2e-5, rtol=1e-4)


@needs_kernel
def test_paged_prefill_refuses_what_it_cannot_compute():
    # head sizes in whole vectors: 16 floats with AVX-512, 8 with AVX2
    assert not kernels.prefill_supported(36) and kernels.prefill_supported(128)
    q, k_cache, v_cache, table, first_rows = _case(4, 2, 36, torch.float32, 16, [0], [8])
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="head size 36"):
        kernels.paged_prefill(q, torch.empty_like(q), first_rows, one, torch.tensor([8]),
                              k_cache, v_cache, table, None, 1.0)
    q, k_cache, v_cache, table, first_rows = _case(4, 2, 64, torch.float32, 16, [0], [8])
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_prefill(q, torch.empty_like(q), first_rows.int(), one, torch.tensor([8]),
                              k_cache, v_cache, table, None, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.paged_prefill(q, torch.empty_like(q), first_rows, one, torch.tensor([8]),
                              k_cache, v_cache.bfloat16(), table, None, 1.0)
    with pytest.raises(ValueError, match="per sequence"):
        kernels.paged_prefill(q, torch.empty_like(q), first_rows, torch.tensor([0, 0]),
                              torch.tensor([8]), k_cache, v_cache, table, None, 1.0)
    with pytest.raises(ValueError, match="out shaped as q"):
        kernels.paged_prefill(q, torch.empty_like(q[:4]), first_rows, one, torch.tensor([8]),
                              k_cache, v_cache, table, None, 1.0)


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (8, 1, 32), (6, 2, 96),
                                              (8, 2, 256)])
@pytest.mark.parametrize("window", [None, 23, 300])
@pytest.mark.parametrize("block_size", [16, 5])
def test_the_amx_kernel_matches_gather_and_sdpa_within_bf16_rounding(heads, kv_heads, d, window,
                                                                      block_size):
    """Whole prompts and later chunks (one far into its sequence, past a key tile) of five
    sequences in one call; queries and probabilities are rounded to bf16 for the products,
    so the outputs are close to the fp32 math over the same cache, not equal."""
    starts, lens = [0, 37, 5, 0, 300], [150, 64, 1, 17, 333]
    q, k_cache, v_cache, table, first_rows = _case(heads, kv_heads, d, torch.bfloat16,
                                                   block_size, starts, lens, seed=d)
    out = torch.full_like(q, float("nan"))
    kernels.paged_prefill(q, out, first_rows, torch.tensor(starts), torch.tensor(lens),
                          k_cache, v_cache, table, window, d ** -0.5, amx=True)
    ref = torch.cat(reference_prefill(q, k_cache, v_cache, table, first_rows.tolist(), starts,
                                      lens, window, d ** -0.5))
    torch.testing.assert_close(out[1:-1], ref, atol=1.5e-2, rtol=1.5e-2)
    assert (out[1:-1] - ref).abs().mean() < 2e-3  # rounding, not a wrong key here and there
    assert out[0].isnan().all() and out[-1].isnan().all()


@needs_amx
@pytest.mark.parametrize("window", [None, 100])
def test_the_amx_kernel_gives_a_prompt_row_the_same_bits_whatever_chunk_it_falls_in(window):
    """A prompt of 600 tokens (three key tiles) at once, and cut in chunks of 1, 100, 263
    and 236 rows at their positions (the cache already holding the keys before each):
    every row's output bits alike, so the rows' running max, rescaling and masking do not
    depend on which rows share a 16-row block."""
    q, k_cache, v_cache, table, first_rows = _case(9, 3, 64, torch.bfloat16, 16, [0], [600], seed=7)
    whole = torch.full_like(q, float("nan"))
    kernels.paged_prefill(q, whole, first_rows, torch.tensor([0]), torch.tensor([600]), k_cache,
                          v_cache, table, window, 0.125, amx=True)
    cut = torch.full_like(q, float("nan"))
    start = 0
    for n in (1, 100, 263, 236):
        kernels.paged_prefill(q, cut, first_rows + start, torch.tensor([start]), torch.tensor([n]),
                              k_cache, v_cache, table, window, 0.125, amx=True)
        start += n
    assert torch.equal(cut[1:-1], whole[1:-1])


@needs_amx
def test_the_amx_kernel_refuses_what_it_cannot_compute():
    assert kernels.prefill_supported(32, amx=True) and not kernels.prefill_supported(80, amx=True)
    one, eight = torch.tensor([0]), torch.tensor([8])
    q, k_cache, v_cache, table, first_rows = _case(4, 2, 80, torch.bfloat16, 16, [0], [8])
    with pytest.raises(ValueError, match="on AMX does not run head size 80"):
        kernels.paged_prefill(q, torch.empty_like(q), first_rows, one, eight, k_cache, v_cache,
                              table, None, 1.0, amx=True)
    q, k_cache, v_cache, table, first_rows = _case(4, 2, 64, torch.float32, 16, [0], [8])
    with pytest.raises(ValueError, match="bf16 cache"):
        kernels.paged_prefill(q, torch.empty_like(q), first_rows, one, eight, k_cache, v_cache,
                              table, None, 1.0, amx=True)


def _chunk_case():
    """A prompt chunk of 64 tokens at position 37 of its sequence, as the runner groups it."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    q, k_cache, v_cache, table, _ = _case(heads, kv_heads, d, torch.float32, bs, [37], [64])
    q = q[1:-1]
    k, v = torch.randn(64, kv_heads, d), torch.randn(64, kv_heads, d)
    pos = torch.arange(37, 101)
    slots = table[0][pos // bs] * bs + pos % bs
    keys = torch.arange(table.shape[1] * bs)
    group = AttentionGroup(
        token_index=torch.arange(64)[None], valid_flat=None, token_rows=torch.arange(64),
        block_table=table, last_pos=torch.tensor([100]),
        mask=(keys[None, :] <= pos[:, None])[None, None], first_row=torch.tensor([0]),
        first_pos=torch.tensor([37]), query_len=torch.tensor([64]), prompt=True)
    return q, k, v, k_cache, v_cache, AttentionMetadata(slot_mapping=slots, groups=[group])


@needs_kernel
def test_the_backend_takes_the_kernel_for_prompt_groups_and_matches_sdpa(monkeypatch):
    """Through the backend with and without the native kernels (the chunk's K/V are
    written into the cache first)."""
    q, k, v, k_cache, v_cache, meta = _chunk_case()
    calls = []
    monkeypatch.setattr(kernels, "paged_prefill", _counting(kernels.paged_prefill, calls))
    native = TorchPagedAttention(0.125, kernels=kernels)(q, k, v, k_cache.clone(),
                                                         v_cache.clone(), meta)
    assert len(calls) == 1
    plain = TorchPagedAttention(0.125)(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    torch.testing.assert_close(native, plain, atol=2e-5, rtol=1e-4)


def test_the_backend_keeps_sdpa_where_the_cpu_cannot_run_the_kernel(monkeypatch):
    q, k, v, k_cache, v_cache, meta = _chunk_case()
    calls = []
    monkeypatch.setattr(kernels, "prefill_supported", lambda head_dim, amx=False: False)
    monkeypatch.setattr(kernels, "paged_prefill", _counting(kernels.paged_prefill, calls))
    out = TorchPagedAttention(0.125, kernels=kernels)(q, k, v, k_cache.clone(), v_cache.clone(),
                                                      meta)
    plain = TorchPagedAttention(0.125)(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    assert calls == []
    torch.testing.assert_close(out, plain)


@pytest.mark.parametrize("chunk", [False, True])
def test_prompts_over_a_bf16_cache_with_amx_prompts_take_the_kernel_this_cpu_runs(monkeypatch, chunk):
    """With ``amx_prompts`` a prompt group over a bf16 cache computes in bf16 on the native AMX
    kernel where this CPU runs it; where it runs only the native fp32 prefill kernel, on that
    (the fp32 math over the bf16 cache, as decode rows take); with neither, in one bf16 SDPA.
    Either way its output stays within bf16 rounding of the fp32 math over the same cache,
    for a whole prompt (causal) and a later chunk (masked)."""
    if chunk:
        q, k, v, k_cache, v_cache, meta = _chunk_case()
    else:
        q, k_cache, v_cache, table, _ = _case(9, 3, 64, torch.float32, 16, [0], [150])
        q = q[1:-1]
        k, v = torch.randn(150, 3, 64), torch.randn(150, 3, 64)
        slots = (table[0][torch.arange(150) // 16] * 16 + torch.arange(150) % 16)
        meta = AttentionMetadata(slot_mapping=slots, groups=[AttentionGroup(
            token_index=torch.arange(150)[None], valid_flat=None, token_rows=torch.arange(150),
            block_table=table, last_pos=torch.tensor([149]), mask=None,
            first_row=torch.tensor([0]), first_pos=torch.tensor([0]),
            query_len=torch.tensor([150]), prompt=True)])
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    calls = []
    monkeypatch.setattr(kernels, "paged_prefill", _counting(kernels.paged_prefill, calls))
    amx = TorchPagedAttention(0.125, kernels=kernels, amx_prompts=True)(
        q, k, v, k_cache.clone(), v_cache.clone(), meta)
    native_fp32 = not has_amx_kernel and kernels.prefill_supported(64)
    assert len(calls) == (1 if has_amx_kernel or native_fp32 else 0) and amx.dtype == torch.float32
    fp32 = TorchPagedAttention(0.125, amx_prompts=False)(q, k, v, k_cache.clone(),
                                                        v_cache.clone(), meta)
    if native_fp32:  # the fp32 math, only its order of sums differing
        torch.testing.assert_close(amx, fp32, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(amx, fp32, atol=2e-2, rtol=2e-2)
    assert (amx - fp32).abs().max() > 0  # computed in bf16, not the fp32 path again
    if has_amx_kernel:  # and torch's bf16 SDPA, without the kernels, agrees as closely
        sdpa = TorchPagedAttention(0.125, amx_prompts=True)(q, k, v, k_cache.clone(),
                                                           v_cache.clone(), meta)
        torch.testing.assert_close(amx, sdpa, atol=2e-2, rtol=2e-2)


def _counting(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapper


@needs_kernel
@pytest.mark.parametrize("context,start", [(40, 0), (70, 30)])
def test_bench_attention_times_prompts_against_sdpa(capsys, context, start):
    from tandem.cli.main import main

    assert main(["bench", "attention", "--prompt", "40", "--context", str(context), "--rows", "2",
                 "--layers", "2", "--repeats", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"2 rows x 40 tokens at {start}..{context - 1}, 9/3 heads of 64, 2 layers" in out
    plain = re.search(r"gather \+ SDPA ([\d.]+) ms \(\d+ GFLOP/s\)", out)
    native = re.search(r"native ([\d.]+) ms \(\d+ GFLOP/s\): ([\d.]+)x", out)
    assert plain and native and float(plain.group(1)) > 0 and float(native.group(1)) > 0, out
