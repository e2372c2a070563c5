"""bf16 linears on AMX tiles (where the CPU has AMX-BF16) and on AVX-512 (where it has
AVX-512 BF16: vdpbf16ps and the FMAs over widened weights, each run as a CPU without AMX
would) against the bf16 product they stand for: x rounded to bf16, fp32 sums, bias
added, each output rounded to bf16 (an LM head's left as the fp32 sums). The fused MLP
forms are AMX's alone."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import amx_linear, bf16_avx512_linear, cpu_features, cpu_kernels, onednn
from tandem.engine.model.config import ModelConfig
from tandem.engine.model.llama import LlamaModel
from tandem.engine.kernels.onednn import AMX, BF16_AVX512, CpuLinear

AMX_KERNELS, AVX512_KERNELS = amx_linear.load(), bf16_avx512_linear.load()
no_amx = pytest.mark.skipif(AMX_KERNELS is None, reason="no AMX-BF16 on this machine")


def _avx512(fma: bool) -> bf16_avx512_linear.Bf16Avx512Kernels:
    if AVX512_KERNELS is None:
        pytest.skip("no AVX-512 BF16 on this machine")
    return bf16_avx512_linear.Bf16Avx512Kernels(cpu_kernels.load(), fma=fma)


@pytest.fixture(params=["amx", "avx512-dot", "avx512-fma"])
def pair(request, monkeypatch):
    """(kernels, their storage layout) for each bf16 kernel this CPU runs; for the AVX-512
    ones the engine picks its layouts and kernel as on a CPU without AMX that takes it."""
    if request.param == "amx":
        if AMX_KERNELS is None:
            pytest.skip("no AMX-BF16 on this machine")
        return AMX_KERNELS, AMX
    kernels = _avx512(fma=request.param == "avx512-fma")
    monkeypatch.setattr(amx_linear, "load", lambda: None)
    monkeypatch.setattr(bf16_avx512_linear, "load", lambda: kernels)
    return kernels, BF16_AVX512


@pytest.mark.skipif(cpu_features.cpu_vendor() != "GenuineIntel", reason="vdpbf16ps as Intel defines it")
def test_the_fmas_are_intels_vdpbf16ps():
    """Two RNE FMAs a pair, the odd input's first: the sums of the dot products to the bit
    (so either kernel could serve a machine of this maker), unrounded and rounded."""
    dot, fma = _avx512(fma=False), _avx512(fma=True)
    gen = torch.Generator().manual_seed(9)
    for n, k in ((960, 576), (37, 70), (576, 1536)):
        w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
        packed = dot.pack(w)
        for m in (1, 7, 300):
            x = torch.randn(m, k, generator=gen)
            for rounded in (True, False):
                assert torch.equal(dot.linear(x, packed, b, n, rounded), fma.linear(x, packed, b, n, rounded))


def test_an_intel_cpu_takes_the_fmas_and_others_the_dot_products(monkeypatch):
    if AVX512_KERNELS is None:
        pytest.skip("no AVX-512 BF16 on this machine")
    monkeypatch.delenv(bf16_avx512_linear.KERNEL_ENV, raising=False)
    cases = [("GenuineIntel", None, True), ("AuthenticAMD", None, False), ("", None, False),
             ("GenuineIntel", "dot", False), ("AuthenticAMD", "fma", True)]
    try:
        for vendor, chosen, fma in cases:
            monkeypatch.setattr(cpu_features, "cpu_vendor", lambda v=vendor: v)
            if chosen:
                monkeypatch.setenv(bf16_avx512_linear.KERNEL_ENV, chosen)
            bf16_avx512_linear.load.cache_clear()
            assert bf16_avx512_linear.load().fma == fma, (vendor, chosen)
        monkeypatch.setenv(bf16_avx512_linear.KERNEL_ENV, "amx")
        bf16_avx512_linear.load.cache_clear()
        with pytest.raises(ValueError, match="must be dot or fma"):
            bf16_avx512_linear.load()
    finally:
        bf16_avx512_linear.load.cache_clear()


def _one_layer_config(tied: bool) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": tied})


def _reference(x, w, b):
    y = x.bfloat16().double() @ w.double().T + (0 if b is None else b.double())
    return y.bfloat16().float()


def _allowed(x, w, ref, kernels):
    """How far a kernel's output may lie from ``_reference``: one bf16 step; on AVX-512,
    where each output is one fp32 chain over K, plus what such a chain can lose against
    float64 (K units of fp32 rounding of the sum of |terms|: where the terms cancel, more
    than a step of the small result)."""
    step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    if kernels is AMX_KERNELS:
        return step
    terms = x.bfloat16().double().abs() @ w.double().abs().T
    return step + x.shape[1] * torch.finfo(torch.float32).eps * terms.float()


@pytest.mark.parametrize("n,k", [(960, 576), (37, 100), (48, 64), (576, 1536), (5, 31)])
@pytest.mark.parametrize("m", [1, 5, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_bf16_product_within_its_rounding(n, k, m, bias, pair):
    kernels = pair[0]
    gen = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    got = kernels.linear(x, kernels.pack(w), b, n)
    ref = _reference(x, w, b)
    assert ((got - ref).abs() <= _allowed(x, w, ref, kernels)).all()
    assert (got == ref).float().mean() > 0.9
    assert torch.equal(got, got.bfloat16().float())  # every output a bf16 value


def test_a_head_returns_the_fp32_sums_unrounded(pair):
    kernels = pair[0]
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(300, 576, generator=gen).bfloat16(), torch.randn(300, generator=gen)
    x = torch.randn(40, 576, generator=gen)
    packed = kernels.pack(w)
    sums = kernels.linear(x, packed, b, 300, round_output=False)
    ref = x.bfloat16().double() @ w.double().T + b.double()
    assert torch.allclose(sums.double(), ref, rtol=1e-5, atol=1e-4)  # fp32 sums in another order
    assert not torch.equal(sums, sums.bfloat16().float())
    # the layers' output is the same sums, rounded
    assert torch.equal(kernels.linear(x, packed, b, 300), sums.bfloat16().float())


def test_a_near_tie_in_the_logits_goes_to_the_larger_logit(pair):  # on each kernel
    """Logits 20.02 and 20.05 round to one bf16 value (20.0; a step of 0.125 there), so a
    rounded head ties them and the lower id wins; the head's unrounded logits do not."""
    w = torch.zeros(2, 64)
    w[0, 0], w[1, 0] = 1.0, 1.0
    w[0, 1], w[1, 1] = 0.015625, 0.046875  # bf16 values; hidden 1.28 rounds to 1.28125: 20.02, 20.06
    hidden = torch.zeros(1, 64)
    hidden[0, 0], hidden[0, 1] = 20.0, 1.28
    head = CpuLinear(w, None, torch.bfloat16, True, "packed", logits=True)
    rounded = CpuLinear(w, None, torch.bfloat16, False, "blocked")  # oneDNN's product
    logits, tied = head(hidden)[0], rounded(hidden)[0]
    assert tied[0] == tied[1] and tied.argmax() == 0
    assert logits[1] - logits[0] > 0.03 and logits.argmax() == 1


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["packed", "blocked", "plain"])
def test_a_bf16_lm_head_takes_the_kernels_layout_whatever_the_layers_layout(tied, layout, pair):
    """So a pool gets the same unrounded logits whatever layout its layers take."""
    kernels_layout = pair[1]
    cfg = _one_layer_config(tied=tied)
    torch.manual_seed(1)
    model, reference = LlamaModel(cfg), LlamaModel(cfg)
    reference.load_state_dict(model.state_dict())
    model.use_onednn(torch.bfloat16, layout=layout)
    reference.use_onednn(torch.bfloat16, layout="packed")
    assert onednn.head_layout(layout, torch.bfloat16, True) == "packed"
    assert onednn.head_layout(layout, torch.float32, True) == layout
    assert onednn.head_layout(layout, torch.bfloat16, False) == layout  # no native kernels
    head = model.lm_head
    assert head.layout == kernels_layout and head.packed_options == {"round_output": False}
    assert model.layers[0].down_proj.layout == onednn.storage_layout(layout, torch.bfloat16, True)
    assert isinstance(model.embed_tokens, amx_linear.AmxEmbedding) == tied
    hidden = torch.randn(3, 64)
    assert torch.equal(head(hidden), reference.lm_head(hidden))


def test_a_row_gives_the_same_bits_alone_and_in_any_batch(pair):
    kernels = pair[0]
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 96, generator=gen).bfloat16(), torch.randn(200, generator=gen)
    packed = kernels.pack(w)
    x = torch.randn(70, 96, generator=gen)
    batch = kernels.linear(x, packed, b, 200)
    for r in (0, 31, 32, 69):
        assert torch.equal(kernels.linear(x[r:r + 1].clone(), packed, b, 200)[0], batch[r])
    assert kernels.linear(x[:0], packed, b, 200).shape == (0, 200)


@no_amx
@pytest.mark.parametrize("inter,k", [(16, 31), (48, 64), (1536, 576), (96, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_gate_up_silu_is_bit_identical_to_the_product_then_silu_mul(inter, k, bias):
    kernels = AMX_KERNELS
    gen = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    b = torch.randn(2 * inter, generator=gen) if bias else None
    packed = kernels.pack(w)
    for rows in (1, 5, 31, 33, 300, 1030):  # 1,030: more than one L2 panel of rows at K 576
        x = torch.randn(rows, k, generator=gen)
        want = cpu_kernels.load().silu_mul(kernels.linear(x, packed, b, 2 * inter))
        assert torch.equal(kernels.gate_up_silu(x, packed, b, 2 * inter), want), rows
    assert kernels.gate_up_silu(x[:0], packed, b, 2 * inter).shape == (0, inter)
    assert kernels.fuses_gate_up(2 * inter)
    assert not any(kernels.fuses_gate_up(n) for n in (2 * inter - 16, 2 * inter + 1, 0))
    with pytest.raises(ValueError, match="16-output blocks"):
        kernels.gate_up_silu(x, kernels.pack(w[:2 * inter - 16]), None, 2 * inter - 16)


@no_amx
@pytest.mark.parametrize("inter,hidden", [(48, 64), (1536, 576), (32, 40), (80, 96)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_an_mlp_in_one_call_is_bit_identical_to_its_three_steps(inter, hidden, bias, threads):
    """gate|up with its SiLU·mul, then down: inter 48 and 80 leave half a 32-input block of
    the down product's input, which must read as zeros, not as whatever was in memory; on
    several threads the down product starts only once every row of the activation is in."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_mlp(inter, hidden, bias)
    finally:
        torch.set_num_threads(before)


def _check_mlp(inter, hidden, bias):
    kernels = AMX_KERNELS
    gen = torch.Generator().manual_seed(inter * hidden)
    wgu = torch.randn(2 * inter, hidden, generator=gen).bfloat16()
    wd = torch.randn(hidden, inter, generator=gen).bfloat16()
    bgu, bd = (torch.randn(2 * inter, generator=gen), torch.randn(hidden, generator=gen)) if bias \
        else (None, None)
    pgu, pd = kernels.pack(wgu), kernels.pack(wd)
    for rows in (1, 7, 33, 300):
        x = torch.randn(rows, hidden, generator=gen)
        want = kernels.linear(kernels.gate_up_silu(x, pgu, bgu, 2 * inter), pd, bd, hidden)
        assert torch.equal(kernels.mlp(x, pgu, bgu, 2 * inter, pd, bd, hidden), want), rows
    assert kernels.mlp(x[:0], pgu, bgu, 2 * inter, pd, bd, hidden).shape == (0, hidden)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.mlp(x, pgu, bgu, 2 * inter, pgu, None, hidden)


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_every_row_of_a_long_prompt_is_written_once_and_right(threads, pair):
    """Blocks are written out while the next item computes (AMX), a few rows per step over
    K, items run by L2 panels of rows: every row of every block, across panels and uneven
    splits over threads, lands where it belongs."""
    kernels = pair[0]
    gen = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        for n, k in ((960, 576), (80, 32), (576, 1536), (96, 64)):  # all but the second fused
            w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
            packed = kernels.pack(w)
            x = torch.randn(1100, k, generator=gen)
            torch.set_num_threads(threads)
            batch = kernels.linear(x, packed, b, n)
            fused = kernels.gate_up_silu(x, packed, b, n) if kernels.fuses_gate_up(n) else None
            torch.set_num_threads(before)
            rows = torch.cat([kernels.linear(x[r:r + 100].clone(), packed, b, n) for r in range(0, 1100, 100)])
            assert torch.equal(batch, rows)
            assert fused is None or torch.equal(fused, cpu_kernels.load().silu_mul(rows))
            ref = _reference(x, w, b)
            assert ((batch - ref).abs() <= _allowed(x, w, ref, kernels)).all()
    finally:
        torch.set_num_threads(before)


def test_it_refuses_what_it_cannot_compute(pair):
    kernels = pair[0]
    w = torch.randn(48, 64).bfloat16()
    with pytest.raises(ValueError, match="bf16 CPU weights"):
        kernels.pack(w.float())
    packed = kernels.pack(w)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear(torch.randn(2, 65), packed, None, 48)
    with pytest.raises(ValueError, match="fp32"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed, None, 48)


def test_a_bf16_cpu_linear_asked_to_be_packed_takes_the_kernels_layout(pair):
    layout = pair[1]
    w, b = torch.randn(100, 64), torch.randn(100)
    assert onednn.storage_layout("packed", torch.bfloat16, True) == layout
    assert onednn.storage_layout("packed", torch.bfloat16, False) == "blocked"  # no native kernels
    assert onednn.storage_layout("blocked", torch.bfloat16, True) == "blocked"
    lin = CpuLinear(w, b, torch.bfloat16, True, "packed")
    blocked = CpuLinear(w, b, torch.bfloat16, True, "blocked")
    assert lin.layout == layout and not lin.runs_on_onednn(1 << 20)
    x = torch.randn(3, 7, 64)
    got, ref = lin(x), blocked(x)
    assert got.shape == ref.shape == (3, 7, 100) and got.dtype == torch.float32
    step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    assert ((got - ref).abs() <= step).all()


@pytest.mark.parametrize("vocab,dim", [(1, 24), (16, 64), (100, 576), (37, 33)])
def test_an_embedding_reads_the_plain_tables_rows_from_the_packed_weight(vocab, dim, pair):
    kernels = pair[0]
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(vocab)).bfloat16()
    embed = amx_linear.AmxEmbedding(kernels.pack(table), vocab, dim)
    every = torch.arange(vocab)
    assert torch.equal(embed(every), table)
    ids = torch.randint(0, vocab, (3, 5))
    assert torch.equal(embed(ids), table[ids])  # [B, T] -> [B, T, K]
    assert embed(every[:0]).shape == (0, dim)
    for bad in (vocab, -1):  # the padded blocks' outputs are not rows
        with pytest.raises(IndexError, match=f"in \\[0, {vocab}\\)"):
            embed(torch.tensor([0, bad]))
    with pytest.raises(ValueError, match="AMX-packed table"):
        amx_linear.AmxEmbedding(kernels.pack(table), vocab + 32, dim)


def test_a_tied_bf16_head_is_stored_once_in_the_kernels_layout(pair):
    """The head streams the packed table and the lookup reads that same tensor: the
    plain table's rows, and its logits within the bf16 rounding."""
    layout = pair[1]
    cfg = _one_layer_config(tied=True)
    torch.manual_seed(0)
    packed, plain = LlamaModel(cfg), LlamaModel(cfg)
    plain.load_state_dict(packed.state_dict())
    table = packed.embed_tokens.weight.detach().bfloat16()
    packed.use_onednn(torch.bfloat16, layout="packed")
    plain.use_onednn(torch.bfloat16, native=False, layout="blocked")  # oneDNN's head, rounded
    embed, head = packed.embed_tokens, packed.lm_head
    assert isinstance(embed, amx_linear.AmxEmbedding) and head.layout == layout
    assert embed.weight is head.weight  # stored once
    assert not any(p.shape == table.shape for p in packed.parameters())
    ids = torch.tensor([0, 5, 99])
    assert torch.equal(embed(ids), table[ids])
    hidden = torch.randn(5, 64)
    got, ref = head(hidden), plain.lm_head(hidden)
    step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
    assert ((got - ref).abs() <= step).all()
