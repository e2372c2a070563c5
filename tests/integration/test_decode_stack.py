"""The native decode stack against the Python forward it replaces: the same tokens,
logprobs and KV bits, per model family, weight layout (packed, plain, int8) and weight dtype."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.kernels import (amx_linear, bf16_avx512_linear, cpu_features, cpu_kernels, packed_linear)
from tandem.engine.kernels.cpu_kernels import GEMV_MAX_ROWS
from tandem.engine.model.decode_stack import DecodeStack
from tandem.engine.kernels.onednn import AMX, BF16_AVX512, PAIR_PACKED
from tests.cpu_class import AMX_FLAGS, hidden_cpu_flags
from tests.hf_models import write_hf_checkpoint

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    return {arch: write_hf_checkpoint(arch, root / arch, tiny_model_dir)
            for arch in ("llama3", "mistral", "qwen2", "qwen3")}


def _engine(path, dtype: str, layout: str = "plain") -> LLM:
    """``layout`` int8: weight-only int8 (its own packed layout)."""
    weights = {"quantization": "int8"} if layout == "int8" else {"cpu_weight_layout": layout}
    return LLM(str(path), num_threads=2, seed=0, max_model_len=256, enable_prefix_caching=False,
               dtype=dtype, num_blocks=256, **weights)


def _stack_steps(monkeypatch) -> list[int]:
    """The rows of each step the decode stack runs from now on."""
    steps: list[int] = []
    run = DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, ids, *a: steps.append(len(ids)) or run(self, ids, *a))
    return steps


def _run(llm: LLM, n: int):
    # 45-60 token prompts: past mistral's 40-token sliding window
    prompts = [[(7 * i + 3 * j) % 1000 + 2 for j in range(45 + 3 * i)] for i in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=1)]
    outs = llm.generate(prompts, [params[i % 2] for i in range(n)])
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], \
        llm.engine.kv_cache.kv.clone()


# (layout, weight dtype, rows of the widest step run): plain weights take the GEMV's rows,
# packed and int8 ones any (bf16 weights packed: the AMX layout, where the CPU has it;
# avx512-dot / -fma: packed as a CPU with AVX-512 BF16 but without AMX packs them, run by
# vdpbf16ps or by the FMAs)
CASES = [("plain", "float32", GEMV_MAX_ROWS), ("plain", "bfloat16", 2),
         ("packed", "float32", GEMV_MAX_ROWS + 8), ("packed", "bfloat16", GEMV_MAX_ROWS + 8),
         ("avx512-dot", "bfloat16", GEMV_MAX_ROWS + 8), ("avx512-fma", "bfloat16", GEMV_MAX_ROWS + 8),
         ("int8", "float32", GEMV_MAX_ROWS + 8)]


@pytest.mark.parametrize("layout,dtype,rows", CASES)
@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2"])
def test_the_stack_writes_what_the_python_forward_writes(checkpoints, arch, layout, dtype, rows,
                                                         monkeypatch):
    if dtype == "bfloat16" and not cpu_features.has_native_bf16():
        pytest.skip("no AVX-512 BF16 / AMX: bf16 weights run on the torch path")
    if layout == "packed" and packed_linear.load() is None:
        pytest.skip("no AVX-512 or AVX2 + FMA: weights asked to be packed take oneDNN's layout")
    if (layout, dtype) == ("packed", "bfloat16") and amx_linear.load() is None:
        pytest.skip("no AMX-BF16: bf16 weights asked to be packed take another layout")
    case = layout
    with hidden_cpu_flags(*AMX_FLAGS) if case.startswith("avx512") else contextlib.nullcontext():
        _check_stack(checkpoints[arch], case, layout, dtype, rows, monkeypatch)


def _check_stack(checkpoint, case, layout, dtype, rows, monkeypatch):
    """The native stack against the Python forward for one case (run as the CPU it names)."""
    if layout.startswith("avx512"):
        if bf16_avx512_linear.load() is None:
            pytest.skip("no AVX-512 BF16")
        kernels = bf16_avx512_linear.Bf16Avx512Kernels(cpu_kernels.load(), fma=layout == "avx512-fma")
        monkeypatch.setattr(bf16_avx512_linear, "load", lambda: kernels)
        layout = "packed"
    native_llm, python_llm = (_engine(checkpoint, dtype, layout) for _ in range(2))
    if (layout, dtype) == ("packed", "bfloat16"):
        assert native_llm.engine.runner.model.layers[0].qkv_proj.layout == \
            (AMX if amx_linear.load() is not None else BF16_AVX512)
    stack = native_llm.engine.runner.model.decode_stack
    assert stack is not None and stack.max_rows == (rows if layout == "plain" else sys.maxsize)
    if case.startswith("avx512"):  # the C kernel the stack calls is the one Python runs
        assert stack._stack.weights == (6 if case == "avx512-fma" else 5)
    python_llm.engine.runner.model.decode_stack = None
    steps = _stack_steps(monkeypatch)
    native, native_kv = _run(native_llm, rows)
    assert steps and max(steps) == rows  # the batch's decode steps ran native
    python, python_kv = _run(python_llm, rows)
    assert native == python
    assert torch.equal(native_kv, python_kv)  # two fresh engines: the same blocks written


def test_steps_wider_than_the_gemv_keep_the_python_forward_on_plain_weights(checkpoints, monkeypatch):
    llm = _engine(checkpoints["llama3"], "float32", "plain")
    steps = _stack_steps(monkeypatch)
    _run(llm, GEMV_MAX_ROWS + 1)  # past the GEMV's rows
    assert not steps


def test_no_stack_where_it_cannot_run(checkpoints):
    assert _engine(checkpoints["qwen3"], "float32").engine.runner.model.decode_stack is None  # q/k norms
    assert _engine(checkpoints["llama3"], "float32", "blocked").engine.runner.model.decode_stack is None
    if cpu_features.has_native_bf16():
        bf16 = _engine(checkpoints["llama3"], "bfloat16", "packed").engine.runner.model
        # bf16 packed: a bf16 kernel's layout, which the stack runs, or blocked, which it cannot
        assert (bf16.layers[0].qkv_proj.layout in PAIR_PACKED) == (bf16.decode_stack is not None)
    no_kernels = LLM(str(checkpoints["llama3"]), num_threads=2, max_model_len=256, num_blocks=64,
                     cpu_weight_layout="plain", cpu_kernels=False)
    assert no_kernels.engine.runner.model.decode_stack is None


def test_the_stack_refuses_what_it_cannot_run(checkpoints):
    llm = _engine(checkpoints["llama3"], "float32")
    model, kv = llm.engine.runner.model, llm.engine.kv_cache.kv
    stack, vocab = model.decode_stack, model.config.vocab_size
    blocks, block_size = kv.shape[2], kv.shape[3]

    def step(rows: int):  # ids, positions, slots, block ids: row r at position r of block r
        return [5] * rows, list(range(rows)), [r * block_size + r for r in range(rows)], [[r] for r in range(rows)]

    with pytest.raises(ValueError, match=f"1..{GEMV_MAX_ROWS} rows on these weights, not {GEMV_MAX_ROWS + 1}"):
        stack.run(*step(GEMV_MAX_ROWS + 1), kv)
    with pytest.raises(ValueError, match="the decode stack needs"):
        stack.run(*step(2), kv[:, :, :4].contiguous()[:1])  # one layer's cache
    ids, positions, slots, block_ids = step(2)
    with pytest.raises(ValueError, match="the decode stack needs"):
        stack.run(ids, positions[:1], slots, block_ids, kv)  # a position for one row of two
    kv_before = kv.clone()
    for bad in ({"slots": [0, blocks * block_size]},  # one past the cache's last slot
                {"ids": [5, vocab]}, {"ids": [-1, 5]},  # not in the embedding table
                {"block_ids": [[0], [blocks]]}, {"block_ids": [[0], [-1]]},  # blocks not in the cache
                {"positions": [0, block_size]}):  # reads a second block its list does not have
        args = dict(ids=ids, positions=positions, slots=slots, block_ids=block_ids) | bad
        with pytest.raises(ValueError, match="must lie in range"):
            stack.run(**args, kv_cache=kv)
    assert torch.equal(kv, kv_before)  # refused before any work
    assert stack.run(ids, positions, slots, block_ids, kv).shape == (2, model.config.hidden_size)


def test_a_per_layer_callback_keeps_the_python_forward(checkpoints, monkeypatch):
    """Layer-wise KV transfer hooks every layer, also of a one-token prompt (a decode-shaped step)."""
    llm = _engine(checkpoints["llama3"], "float32")
    steps = _stack_steps(monkeypatch)
    llm.engine.add_request("one", [7], SamplingParams(max_tokens=2, ignore_eos=True))
    layers_done: list[int] = []
    llm.engine.step(lambda i, seqs: layers_done.append(i))
    assert layers_done == list(range(llm.engine.runner.model.config.num_layers)) and not steps
    llm.engine.step()  # its decode step runs native
    assert steps == [1]
