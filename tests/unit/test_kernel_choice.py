"""The kernel and weight layout of each CPU class, on any host.

Each class's flags are reached by hiding flags (``TANDEM_CPU_FLAGS_OFF``) from a CPU that
has them all; the choice for fp32, bf16 and int8 weights, and for prompts over the cache, is
pinned per class. Where the host itself has a class's flags, a model is loaded with the rest
hidden and must take that class's choice in its linears and its attention.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_features, cpu_kernels, kernel_choice
from tandem.engine.kernels.kernel_choice import AMX, BF16_AVX512, CLASSES, RULE_FLAGS, KernelChoice
from tandem.engine.model.loader import DTYPES, load_model
from tests.cpu_class import hidden_cpu_flags

# class -> {(dtype, quantization): what the engine runs}; the spec the rule is held to
EXPECTED = {
    "avx2": {
        ("float32", None): KernelChoice("packed", "float32", "fp32"),
        ("bfloat16", None): KernelChoice("torch", "bfloat16", "bf16"),
        ("float32", "int8"): KernelChoice("int8", "float32", "fp32"),
        ("bfloat16", "int8"): KernelChoice("int8", "float32", "fp32"),
    },
    "avx512": {
        ("float32", None): KernelChoice("packed", "float32", "fp32"),
        ("bfloat16", None): KernelChoice("torch", "bfloat16", "bf16"),
        ("float32", "int8"): KernelChoice("int8", "float32", "fp32"),
        ("bfloat16", "int8"): KernelChoice("int8", "float32", "fp32"),
    },
    "avx512-bf16": {
        ("float32", None): KernelChoice("packed", "float32", "fp32"),
        ("bfloat16", None): KernelChoice(BF16_AVX512, "float32", "fp32"),
        ("float32", "int8"): KernelChoice("int8", "float32", "fp32"),
        ("bfloat16", "int8"): KernelChoice("int8", "float32", "fp32"),
    },
    "avx512-amx": {
        ("float32", None): KernelChoice("packed", "float32", "fp32"),
        ("bfloat16", None): KernelChoice(AMX, "float32", "bf16"),
        ("float32", "int8"): KernelChoice("int8", "float32", "fp32"),
        ("bfloat16", "int8"): KernelChoice("int8", "float32", "bf16"),
    },
}
RICHEST = CLASSES["avx512-amx"]


@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_each_class_reached_by_hiding_flags_takes_its_kernels(cls):
    with hidden_cpu_flags(*(RICHEST - CLASSES[cls]), reported=RICHEST) as flags:
        assert flags == CLASSES[cls]
        for (dtype, quantization), expected in EXPECTED[cls].items():
            assert kernel_choice.choose(flags, dtype, quantization) == expected, (cls, dtype, quantization)
        assert cpu_features.has_native_bf16() == (cls in ("avx512-bf16", "avx512-amx"))
        assert cpu_features.vector_isa() == {"avx2": "AVX2", "avx512": "AVX-512",
                                             "avx512-bf16": "AVX-512 BF16", "avx512-amx": "AMX"}[cls]


def test_no_avx2_keeps_onednn_and_unknown_inputs_are_refused():
    assert kernel_choice.choose(frozenset({"sse2"}), "float32") == KernelChoice("blocked", "float32", "fp32")
    assert kernel_choice.choose(frozenset({"avx2"}), "float32").linear == "blocked"  # no FMA
    with pytest.raises(ValueError, match="float16"):
        kernel_choice.choose(RICHEST, "float16")
    with pytest.raises(ValueError, match="int4"):
        kernel_choice.choose(RICHEST, "float32", "int4")


def _reachable(cls: str) -> bool:
    return CLASSES[cls] & RULE_FLAGS <= cpu_features.proc_flags()


def _linear_kind(model) -> str:
    lin = model.layers[0].qkv_proj
    if type(lin).__name__ == "Int8Linear":
        return "int8"
    if isinstance(lin, torch.nn.Linear):
        return "torch"
    return lin.layout


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("cls", sorted(CLASSES))
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                                ("bfloat16", "int8")])
def test_a_model_loaded_as_each_class_this_host_has_takes_its_choice(
        tiny_model_dir, cls, dtype, quantization):
    if not _reachable(cls):
        pytest.skip(f"this CPU lacks {', '.join(sorted(CLASSES[cls] & RULE_FLAGS - cpu_features.proc_flags()))}")
    with hidden_cpu_flags(*(cpu_features.proc_flags() & RICHEST - CLASSES[cls])) as flags:
        if cls == "avx512-amx" and not cpu_features.has_amx_bf16():
            pytest.skip("the OS does not grant AMX tiles to this process")
        expected = kernel_choice.choose(flags, dtype, quantization)
        model = load_model(tiny_model_dir, DTYPES[dtype], torch.device("cpu"), 256, quantization=quantization)
    assert _linear_kind(model) == expected.linear
    assert model.norm.weight.dtype == DTYPES[expected.activations]
    if expected.activations == "float32":  # AMX prompts apply to a bf16 cache only
        assert (model.attn.amx_prompts and dtype == "bfloat16") == (expected.prompt_attention == "bf16")


def test_bf16_weights_on_a_cpu_whose_amx_is_withheld_take_the_avx512_bf16_kernels(monkeypatch):
    # the CPU reports AMX tiles, but the OS grants none (or the AMX kernels do not build):
    # the next native layout, not oneDNN's blocked one
    from tandem.engine.kernels import amx_linear, bf16_avx512_linear, onednn

    with hidden_cpu_flags(reported=RICHEST):
        monkeypatch.setattr(amx_linear, "load", lambda: None)
        monkeypatch.setattr(bf16_avx512_linear, "load", lambda: object())
        assert onednn.storage_layout("packed", torch.bfloat16, True) == BF16_AVX512
        assert onednn.head_layout("blocked", torch.bfloat16, True) == "packed"  # the head too
        monkeypatch.setattr(bf16_avx512_linear, "load", lambda: None)
        assert onednn.storage_layout("packed", torch.bfloat16, True) == "blocked"
