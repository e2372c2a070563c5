"""The CPU parity anchor repeated on CUDA (fp32 token-identical to HF, bf16 first tokens)
with both attention backends (Triton, the default on CUDA, and torch), the Triton kernel
against a float64 reference, CUDA graphs against eager steps, and a batch-1 decode-step
timing of the ``bench`` preset against the H200's memory floor.

Run on a GPU machine with ``pytest -m gpu -s tests/gpu`` (``-s`` shows the timing table).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tests.hf_models import ARCH_CONFIGS, write_hf_checkpoint
from tests.integration.test_engine_parity import MAX_NEW, _hf_greedy, _prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
GPU_LOGPROB_ATOL = 1e-3  # fp32 on GPU: other kernels, other summation orders
H200_BYTES_PER_S = 4.8e12

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", params=sorted(ARCH_CONFIGS))
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = write_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt",
                               tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # CPU reference
    reference = [_hf_greedy(hf, p) for p in _prompts()]
    return path, reference


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("variant", [
    dict(),
    dict(max_num_batched_tokens=24),
    dict(num_blocks=14, block_size=8, max_num_batched_tokens=64),
], ids=["batched", "chunked", "preempting"])
def test_fp32_greedy_matches_transformers_on_cuda(checkpoint, variant, backend):
    path, reference = checkpoint
    llm = LLM(str(path), device=DEVICE, dtype="float32", attention_backend=backend, **variant)
    assert llm.engine.kv_cache.kv.device.type == "cuda"
    assert {p.device.type for p in llm.engine.runner.model.parameters()} == {"cuda"}
    outputs = llm.generate(_prompts(), GREEDY)
    for out, (ref_tokens, ref_rows) in zip(outputs, reference):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"prompt of {len(out.prompt_token_ids)} tokens"
        for lp, row in zip(comp.logprobs, ref_rows):
            assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=GPU_LOGPROB_ATOL)
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_bf16_first_tokens_match_transformers_on_cuda(checkpoint, capsys):
    from transformers import AutoModelForCausalLM

    path, _ = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    llm = LLM(str(path), device=DEVICE, dtype="bfloat16")
    assert llm.engine.dtype == torch.bfloat16
    prompts = _prompts()
    outputs = llm.generate(prompts, GREEDY)
    agree_prefix = []
    for prompt, out in zip(prompts, outputs):
        ids, ref = list(prompt), []
        with torch.no_grad():
            for _ in range(3):
                tok = int(hf(torch.tensor([ids], device=DEVICE)).logits[0, -1].argmax())
                ref.append(tok)
                ids.append(tok)
        got = out.outputs[0].token_ids
        assert got[0] == ref[0], f"first token, prompt of {len(prompt)} tokens"
        agree_prefix.append(next((i for i in range(3) if got[i] != ref[i]), 3))
    with capsys.disabled():
        print(f"\n[{path.parent.name}] bf16 cuda: leading tokens agreeing with HF bf16 "
              f"(of 3): {agree_prefix}")
    assert sum(a == 3 for a in agree_prefix) >= len(prompts) * 3 // 4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("window", [None, 37])
def test_triton_kernel_matches_reference_on_cuda(dtype, tol, window):
    from tandem.gpucheck.kernel_check import MIXED_BATCH, random_batch, reference_attention
    from tandem.engine.kernels import triton_kernels

    torch.manual_seed(0)
    table, starts, ctx = random_batch(MIXED_BATCH, 16, 64, torch.device(DEVICE))
    kc = torch.randn(64, 16, 2, 64, device=DEVICE).to(dtype)
    vc = torch.randn(64, 16, 2, 64, device=DEVICE).to(dtype)
    q = torch.randn(int(starts[-1]), 8, 64, device=DEVICE).to(dtype)
    out = torch.full_like(q, float("nan"))
    triton_kernels.paged_attention(q, out, kc, vc, table, starts, ctx,
                                   max(n for n, _ in MIXED_BATCH), 0.125, window)
    ref = reference_attention(q, kc, vc, table, starts, ctx, 0.125, window)
    assert float((out.float() - ref.float()).abs().max()) <= tol


def test_cuda_graphs_replay_the_eager_tokens(checkpoint):
    path, _ = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        llm = LLM(str(path), device=DEVICE, dtype="float32", cuda_graphs=graphs, max_num_seqs=8)
        assert (llm.engine.runner.graphs is not None) == graphs
        outs[graphs] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
        if graphs:
            assert llm.engine.runner.graphs.replays > 0
    assert outs[True] == outs[False]


def test_auto_dtype_on_cuda_is_the_checkpoint_dtype(tmp_path, tiny_model_dir):
    path = write_hf_checkpoint("llama3", tmp_path / "bf16", tiny_model_dir, dtype=torch.bfloat16)
    assert LLM(str(path), device=DEVICE, num_blocks=16).engine.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_decode_step_timing(tmp_path_factory, dtype, capsys):
    """Print, don't assert: a batch-1 decode step of the bench preset vs the bandwidth floor."""
    from tandem.engine.default_model import write_model

    path = write_model("bench", tmp_path_factory.mktemp("bench") / "model")
    llm = LLM(str(path), device=DEVICE, dtype=dtype, num_blocks=64)
    eng = llm.engine
    model = eng.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    # a decode step reads every weight once, except the embedding table (one row) when untied
    read = total - (embed.numel() * embed.element_size() if model.lm_head is not None else 0)
    floor_ms = read / H200_BYTES_PER_S * 1e3

    eng.add_request("t", list(range(3, 35)),
                    SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    eng.step()  # prefill
    for _ in range(10):  # warm-up decodes
        eng.step()
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    eng.abort("t")
    med = statistics.median(times) * 1e3
    with capsys.disabled():
        print(f"\n[bench {dtype}] weights {total / 1e6:.1f} MB, read per decode step "
              f"{read / 1e6:.1f} MB; H200 floor (4.8 TB/s) {floor_ms:.4f} ms; "
              f"measured median {med:.3f} ms (p10 {sorted(times)[5] * 1e3:.3f}, "
              f"p90 {sorted(times)[45] * 1e3:.3f}) = {med / floor_ms:.0f}x the floor, "
              f"{1e3 / med:.0f} tok/s")
    assert eng.block_pool.num_free == eng.block_pool.num_blocks
