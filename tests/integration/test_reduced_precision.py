"""bf16 weights/KV and int8 weights on CPU against the fp32 engine: closeness, not identity.

Parity here is logprob closeness and greedy agreement with fp32 (reduced precision
is never token-exact); the figures on the real default model are in services/RESULTS.md.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tandem.common.sampling_params import SamplingParams
from tandem.engine.llm import LLM
from tandem.engine.kernels import (amx_linear, bf16_avx512_linear, cpu_features, cpu_kernels, packed_linear)
from tandem.engine.model import loader
from tandem.engine.kernels.cpu_kernels import GEMV_MAX_ROWS
from tandem.engine.kernels.onednn import AMX, BF16_AVX512, CpuLinear
from tandem.engine.kernels.quantized import Int8Linear
from tests.cpu_class import AMX_FLAGS, hidden_cpu_flags
from tests.hf_models import write_hf_checkpoint

STEPS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 400, 500] * 5, [42, 43], list(range(60, 100))]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), num_blocks=64, **kw)


@pytest.fixture(params=[AMX, BF16_AVX512])
def bf16_layout(request) -> Iterator[str]:
    """The packed layout of bf16 weights on each native bf16 CPU this one can stand for:
    AMX where it has AMX-BF16; BF16_AVX512 where it has AVX-512 BF16, the engine then run as
    on a CPU without AMX (no AMX linears, no AMX prompt attention)."""
    if request.param == AMX:
        if amx_linear.load() is None:
            pytest.skip("no AMX-BF16 on this machine")
        yield request.param
        return
    with hidden_cpu_flags(*AMX_FLAGS):
        if bf16_avx512_linear.load() is None:
            pytest.skip("no AVX-512 BF16 on this machine")
        yield request.param


def _closeness(low: LLM, full: LLM) -> tuple[float, float]:
    """(greedy agreement over the common prefix of each output, max first-step logprob gap
    on fp32's top tokens)."""
    agree = total = 0
    gap = 0.0
    for lo, hi in zip(low.generate(PROMPTS, GREEDY), full.generate(PROMPTS, GREEDY)):
        lo, hi = lo.outputs[0], hi.outputs[0]
        for a, b in zip(lo.token_ids, hi.token_ids):
            total += 1
            agree += a == b
            if a != b:
                break  # later tokens follow different prefixes
        top_lo, top_hi = dict(lo.logprobs[0].top), dict(hi.logprobs[0].top)
        gap = max([gap] + [abs(top_lo[t] - top_hi[t]) for t in top_hi if t in top_lo])
    return agree / total, gap


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory, tiny_model_dir) -> Path:
    return write_hf_checkpoint("qwen2", tmp_path_factory.mktemp("tied") / "qwen2", tiny_model_dir)


@pytest.fixture(scope="module")
def fp32_llm(checkpoint) -> LLM:
    return _llm(checkpoint, dtype="float32")


def test_fp32_keeps_one_weight_copy(fp32_llm):
    model = fp32_llm.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules()), "dense Linear left"
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    assert not model.config.tie_word_embeddings  # (tied heads: the test below)
    dense_2d = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert dense_2d == ["embed_tokens.weight"]  # the lookup table; projections only in CpuLinear
    table = model.embed_tokens.weight
    assert model.weight_bytes() - model.weight_bytes(include_embedding=False) \
        == table.numel() * table.element_size()


@pytest.mark.parametrize("layout", ["packed", "plain", "blocked"])
def test_a_tied_head_and_its_table_are_stored_once(tied_checkpoint, layout):
    """Packed, the lookup reads the head's packed weight; otherwise the head reads the plain
    table. Either way one copy, read whole by every decode step."""
    model = _llm(tied_checkpoint, dtype="float32", cpu_weight_layout=layout).engine.runner.model
    reference = load_file(tied_checkpoint / "model.safetensors")["model.embed_tokens.weight"]
    table, head = model.embed_tokens.weight, model.lm_head
    assert model.config.tie_word_embeddings and head.weight.data_ptr() == table.data_ptr()
    assert model.weight_bytes() == model.weight_bytes(include_embedding=False)
    assert not [n for n, p in model.named_parameters() if p.dim() == 2 and n != "embed_tokens.weight"]
    if packed_linear.load() is not None and layout == "packed":
        assert head.layout == "packed" and not [p for p in model.parameters() if p.dim() == 2]
    else:
        assert head.layout == "plain" and table.shape == reference.shape
    ids = torch.arange(reference.shape[0])
    assert torch.equal(model.embed_tokens(ids), reference)
    x = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(head(x), x @ reference.T, atol=1e-4, rtol=1e-4)


def test_bf16_weights_and_kv_stay_close_to_fp32(checkpoint, fp32_llm, bf16_layout):
    low = _llm(checkpoint, dtype="bfloat16")
    model = low.engine.runner.model
    assert low.engine.kv_cache.kv.dtype == torch.bfloat16
    assert {m.weight.dtype for m in model.modules() if isinstance(m, CpuLinear)} == {torch.bfloat16}
    # packed, the default, is asked for: bf16 weights take the AMX layout where the CPU has
    # AMX-BF16, the same blocks for the AVX-512 kernels where it has AVX-512 BF16 (every row count
    # on the native kernel; without either, oneDNN's blocked layout)
    linears = [m for m in model.layers.modules() if isinstance(m, CpuLinear)]
    assert all(m.layout == bf16_layout and m.packed is not None for m in linears)
    assert low.engine.runner.model.decode_stack is not None  # decode steps in one native call
    assert model.act_dtype == torch.float32
    assert model.weight_bytes() < 0.55 * fp32_llm.engine.runner.model.weight_bytes()
    agreement, gap = _closeness(low, fp32_llm)
    assert agreement >= 0.75 and gap < 0.1, (agreement, gap)
    assert gap > 0  # really ran in bf16


@pytest.fixture(scope="module")
def head_32_checkpoint(tmp_path_factory) -> Path:
    from tandem.engine.default_model import write_model

    return write_model("small", tmp_path_factory.mktemp("small") / "model")  # 8 heads of 32


@pytest.mark.parametrize("model", ["checkpoint", "head_32_checkpoint"])
def test_a_bf16_prompt_computes_alike_whatever_chunks_it_is_cut_in(model, request, bf16_layout):
    """The token budget and the prefix cache cut prompts anywhere (a cache hit leaves rows
    of one block to compute): a prompt row's logits must not depend on the chunk it fell
    in (on oneDNN's products they can: the native kernels' only). On AMX every prompt
    chunk, one row too, takes the bf16 products of the AMX attention where it takes the
    head size (32 here), else the fp32 math (16); without AMX, the fp32 math."""
    _check_chunks(request.getfixturevalue(model), "bfloat16")


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("model", ["checkpoint", "head_32_checkpoint"])
def test_an_fp32_prompt_computes_alike_whatever_chunks_it_is_cut_in(model, request):
    """The same in fp32, where the CPU has no AMX (on AMX, fp32 prompts never take it):
    a one-row prompt chunk takes the prompt kernel, not the decode rows' (whose sums
    differ in the last bits at head size 32)."""
    with hidden_cpu_flags(*AMX_FLAGS):
        _check_chunks(request.getfixturevalue(model), "float32")


def _check_chunks(checkpoint: Path, dtype: str) -> None:
    """The same tokens and logprobs for a prompt computed whole, in chunks of 16, 7 and 1
    rows, and after prefix-cache hits."""
    prompt = list(range(60, 100))  # 40 tokens: two full blocks and a partial one
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)

    def run(llm: LLM, cached_tokens: int = 0) -> tuple:
        request = llm.generate([prompt], sampling)[0]
        assert request.num_cached_tokens == cached_tokens
        out = request.outputs[0]
        return out.token_ids, [step.top for step in out.logprobs]

    whole = run(_llm(checkpoint, dtype=dtype, enable_prefix_caching=False))
    for budget in (16, 7, 1):
        llm = _llm(checkpoint, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=budget)
        assert run(llm) == whole, budget
    cached = _llm(checkpoint, dtype=dtype, enable_prefix_caching=True)
    assert run(cached) == whole
    assert run(cached, cached_tokens=32) == whole  # two blocks from the cache, 8 rows computed


def test_bf16_pools_answer_a_near_tie_alike_and_as_fp32_does(bf16_layout):
    """SmolLM2's first token for this question is a near-tie ("The" -1.883, "L" -1.965 in
    fp32) that bf16-rounded logits tie, the lower id ("L") winning: the prefill pool's
    blocked layers answered in French where the decode pool's packed ones said Paris. The
    head is the same native head, unrounded, on both."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    sampling = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    answers = {}
    for dtype, layout in (("float32", "packed"), ("bfloat16", "blocked"), ("bfloat16", "packed")):
        out = LLM(None, dtype=dtype, cpu_weight_layout=layout).chat(question, sampling)[0].outputs[0]
        answers[dtype, layout] = out.text
        top = dict(out.logprobs[0].top)
        assert len(set(top.values())) == len(top), top  # no tie among the first step's top two
    assert len(set(answers.values())) == 1 and "Paris" in answers["float32", "packed"], answers


def test_int8_weights_stay_close_to_fp32(checkpoint, fp32_llm):
    low = _llm(checkpoint, dtype="float32", quantization="int8")
    model = low.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert quantized and not any(isinstance(m, (nn.Linear, CpuLinear)) for m in model.modules())
    if cpu_kernels.load() is not None:
        assert all(m.kernels is not None for m in quantized)  # every row on the int8 kernel
    full_bytes = fp32_llm.engine.runner.model.weight_bytes(include_embedding=False)
    assert model.weight_bytes(include_embedding=False) < 0.3 * full_bytes
    agreement, gap = _closeness(low, fp32_llm)
    assert agreement >= 0.75 and gap < 0.1, (agreement, gap)
    assert gap > 0


def test_bf16_without_native_support_falls_back_to_the_torch_path(checkpoint, fp32_llm,
                                                                     monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        low = _llm(checkpoint, dtype="bfloat16")
    assert "no AVX-512 BF16 or AMX" in caplog.text
    model = low.engine.runner.model
    assert not any(isinstance(m, CpuLinear) for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    agreement, gap = _closeness(low, fp32_llm)
    assert agreement >= 0.5 and gap < 0.2, (agreement, gap)


def test_feature_detection_and_path_choice():
    cpu = torch.device("cpu")
    assert cpu_features.has_native_bf16(frozenset({"avx512_bf16"}))
    assert cpu_features.has_native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not cpu_features.has_native_bf16(frozenset({"avx512f", "avx512_vnni"}))
    assert loader.fp32_activations(torch.float32, cpu, True, None)
    assert loader.fp32_activations(torch.float32, cpu, True, "int8")
    assert not loader.fp32_activations(torch.float16, cpu, True, None)
    assert not loader.fp32_activations(torch.float32, torch.device("cuda"), True, None)
    assert not loader.fp32_activations(torch.bfloat16, cpu, False, None)  # oneDNN off


def test_int8_rejects_what_it_cannot_run(checkpoint):
    with pytest.raises(ValueError, match="unsupported quantization"):
        _llm(checkpoint, quantization="int4")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _llm(checkpoint, quantization="int8", dtype="float16")


def test_fp32_weights_are_packed_blocked_or_plain_as_asked_and_native_kernels_off_keep_onednn(checkpoint):
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler on this machine")
    on = _llm(checkpoint, dtype="float32").engine.runner.model
    layers = [m for m in on.layers.modules() if isinstance(m, CpuLinear)]
    assert layers and all(m.layout == "packed" and m.native_rows == sys.maxsize for m in layers)
    assert all(m.weight.shape == ((m.out_features + 31) // 32, m.in_features, 32) for m in layers)
    off = _llm(checkpoint, dtype="float32", cpu_kernels=False).engine.runner.model
    blocked = _llm(checkpoint, dtype="float32", cpu_weight_layout="blocked").engine.runner.model
    for model in (off, blocked):  # no native kernels: the packed layout falls back to oneDNN's
        layers = [m for m in model.layers.modules() if isinstance(m, CpuLinear)]
        assert layers and all(m.blocked and m.weight.is_mkldnn and m.native_rows == 0 for m in layers)
    assert on.lm_head.layout == "packed" and on.lm_head.native_rows == sys.maxsize
    assert off.lm_head.native_rows == 0
    x = torch.randn(3, on.config.hidden_size)  # the same product every way, to float rounding
    for model in (off, blocked):
        torch.testing.assert_close(on.lm_head(x), model.lm_head(x), atol=1e-4, rtol=1e-4)
    plain = _llm(checkpoint, dtype="float32", cpu_weight_layout="plain").engine.runner.model
    linears = [m for m in plain.modules() if isinstance(m, CpuLinear)]
    assert linears and all(not m.blocked and not m.weight.is_mkldnn and m.native_rows == GEMV_MAX_ROWS for m in linears)
    torch.testing.assert_close(plain.lm_head(x), on.lm_head(x), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cpu_weight_layout must be one of packed, blocked, plain"):
        _llm(checkpoint, cpu_weight_layout="dense")


@pytest.mark.parametrize("shared", [False, True])
def test_a_blocked_fp32_layer_computes_the_plain_product(shared):
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 64, generator=gen), torch.randn(300, generator=gen)
    layer = CpuLinear(w, b, torch.float32, layout="blocked", shared=shared)
    assert layer.blocked != shared and layer.weight.is_mkldnn != shared
    if shared:
        assert layer.weight.data_ptr() == w.data_ptr()
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), x @ w.T + b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_a_row_computes_alike_alone_and_in_a_batch(dtype, tol):
    """Decode rows take the GEMV, larger batches oneDNN: the same row must come out the same
    (to the dtype's rounding), or a token would depend on how many others shared its step."""
    if dtype == torch.bfloat16 and not cpu_features.has_native_bf16():
        pytest.skip("no AVX-512 BF16 / AMX")
    gen = torch.Generator().manual_seed(0)
    layer = CpuLinear(torch.randn(300, 64, generator=gen), torch.randn(300, generator=gen), dtype,
                      layout="plain")  # the layout on which rows can take the GEMV
    rows = GEMV_MAX_ROWS + 4  # past the GEMV: oneDNN
    x = torch.randn(rows, 64, generator=gen)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    torch.testing.assert_close(alone, layer(x), rtol=tol, atol=tol)


def test_a_bf16_head_keeps_the_layers_layout_without_native_bf16_kernels(monkeypatch):
    from tandem.engine.kernels import onednn

    monkeypatch.setattr(amx_linear, "load", lambda: None)
    monkeypatch.setattr(bf16_avx512_linear, "load", lambda: None)
    for layout in ("packed", "blocked", "plain"):
        assert onednn.head_layout(layout, torch.bfloat16, True) == layout
    with pytest.raises(ValueError, match="CPU weight layout must be one of"):
        onednn.head_layout("dense", torch.bfloat16, True)
