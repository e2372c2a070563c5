"""The CUDA attention path's logic on CPU, through Triton's interpreter (TRITON_INTERPRET=1).

The kernels against a float64 reference (GQA groups, block sizes, sliding
window, strided queries, padding sequences), the KV write, and whole engines:
the Triton backend (eager and through the padded decode-graph path) against
the torch backend, token for token.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tandem.gpucheck.kernel_check import random_batch, reference_attention

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    # tests/conftest.py sets it on machines without CUDA, before anything imports triton
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="runs the kernels under Triton's interpreter (TRITON_INTERPRET=1)"),
]


@pytest.fixture(scope="module")
def tk():
    from tandem.engine.kernels import triton_kernels

    return triton_kernels


# (q_len, context) per sequence: decodes, a prefill, chunked prefills, a padding sequence
LENS = [(1, 9), (1, 1), (6, 6), (3, 21), (19, 40), (1, 0)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (4, 4, 16, 16, None),  # MHA
    (4, 2, 16, 8, None),  # GQA 2
    (8, 1, 32, 16, 5),  # MQA, sliding window shorter than a tile
    (8, 2, 24, 4, 13),  # head dim not a power of two, window across blocks
])
def test_paged_attention_matches_reference(tk, heads, kv_heads, head_dim, block_size, window):
    torch.manual_seed(0)
    table, starts, ctx = random_batch(LENS, block_size, 64, torch.device("cpu"))
    k_cache = torch.randn(64, block_size, kv_heads, head_dim)
    v_cache = torch.randn(64, block_size, kv_heads, head_dim)
    t = int(starts[-1])
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim)  # q as a strided view, as in a layer
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
    out = torch.full_like(q, float("nan"))
    tk.paged_attention(q, out, k_cache, v_cache, table, starts, ctx, max(n for n, _ in LENS),
                       head_dim ** -0.5, window)
    ref = reference_attention(q, k_cache, v_cache, table, starts, ctx, head_dim ** -0.5, window)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # no context: zeros, not NaN


def test_paged_attention_rejects_heads_not_a_multiple_of_kv_heads(tk):
    q = torch.zeros(1, 3, 16)
    cache = torch.zeros(4, 8, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        tk.paged_attention(q, q.clone(), cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                           torch.tensor([0, 1]), torch.tensor([1]), 1, 0.25, None)


def test_store_kv_writes_slots_and_skips_padding(tk):
    k = torch.randn(3, 2, 16)
    v = torch.randn(3, 2, 16)
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    tk.store_kv(k, v, k_cache, v_cache, torch.tensor([19, -1, 2]))
    assert torch.equal(k_cache[2, 3], k[0]) and torch.equal(v_cache[2, 3], v[0])
    assert torch.equal(k_cache[0, 2], k[2]) and torch.equal(v_cache[0, 2], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # row 1 (slot -1) wrote nothing


@pytest.fixture(scope="module")
def checkpoint(tk, tmp_path_factory, tiny_model_dir):
    from tests.hf_models import write_hf_checkpoint

    return write_hf_checkpoint("mistral", tmp_path_factory.mktemp("mistral") / "ckpt",
                               tiny_model_dir)  # GQA 2 with a sliding window of 40


def test_engine_on_triton_matches_torch_backend(checkpoint):
    """Prefill, chunked prefill (budget 24), decode past the window, eager and graph path."""
    from tandem.engine import LLM, SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (5, 38)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    common = dict(num_blocks=32, block_size=8, max_num_batched_tokens=24, max_num_seqs=4)
    ref = LLM(str(checkpoint), attention_backend="torch", **common).generate(prompts, params)
    for graphs in (False, True):
        llm = LLM(str(checkpoint), attention_backend="triton", cuda_graphs=graphs, **common)
        runner = llm.engine.runner
        assert type(runner.model.attn).__name__ == "TritonPagedAttention"
        outs = llm.generate(prompts, params)
        for out, want in zip(outs, ref):
            got, exp = out.outputs[0], want.outputs[0]
            assert got.token_ids == exp.token_ids
            for a, b in zip(got.logprobs, exp.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert (runner.graphs is not None) == graphs
        if graphs:
            assert runner.graphs.replays > 0  # decode steps took the padded bucket path
        assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_triton_backend_on_cpu_without_interpreter_is_refused(checkpoint, monkeypatch):
    from tandem.engine import LLM

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA"):
        LLM(str(checkpoint), attention_backend="triton", num_blocks=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_layer_ops_round_as_torch_does(dtype):
    """Residual add + RMSNorm, RoPE on strided q/k views, SiLU-and-mul: one kernel each,
    equal to the torch ops. Not bf16: the interpreter truncates to bf16 where the GPU rounds
    to nearest (gpu-check compares bf16 on the device)."""
    from tandem.engine.model.layer_ops import TorchLayerOps
    from tandem.engine.model.llama import RMSNorm
    from tandem.engine.model.rope import RotaryEmbedding
    from tandem.engine.model.triton_layer_ops import TritonLayerOps

    def close(a, b):
        return torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-6)

    torch.manual_seed(0)
    ref, fused = TorchLayerOps(), TritonLayerOps()
    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x, delta = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
        for d in (delta, None):
            (x1, h1), (x2, h2) = ref.add_norm(x, d, norm), fused.add_norm(x, d, norm)
            assert close(x1, x2) and close(h1, h2)
        rope = RotaryEmbedding(32, 64, 10000.0, None, dtype)
        qkv = torch.randn(5, (4 + 2 * 2) * 32).to(dtype)
        q, k = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32)
        positions = torch.tensor([0, 3, 7, 63, 5])
        (q1, k1), (q2, k2) = ref.rope(rope, q, k, positions), fused.rope(rope, q, k, positions)
        assert close(q1, q2) and close(k1, k2)
        gate_up = torch.randn(5, 2 * 80).to(dtype)
        assert close(ref.silu_mul(gate_up), fused.silu_mul(gate_up))
