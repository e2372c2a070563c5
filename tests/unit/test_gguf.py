"""GGUF reading: every supported tensor type dequantized through a real GGUF file equals
the ``gguf`` package's reference (and transformers' independent dequantizer where it has
one), Q/K un-permuted as transformers does, clear errors for what is not supported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tandem.engine.model.gguf_loader import (  # noqa: E402
    SUPPORTED_TYPES, dequantize_tensor, hf_config, hf_tensor_name, llama3_rope_scaling, unpermute_qk)

ROWS, COLS = 3, 512  # two K-quant super-blocks per row
# Byte offsets of the fp16 scales in each K-quant block (the rest is any bit pattern).
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _raw_blocks(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """(GGUF bytes of a ROWS x COLS tensor of type ``kind``, the floats it was quantized from or None)."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        return x, x
    if kind not in _K_SCALES:
        x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        return gguf.quants.quantize(x, qtype), x
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLS // block_elems, block_bytes), dtype=np.uint8)
    for off in _K_SCALES[kind]:  # finite, modest scales
        scale = rng.uniform(0.001, 0.05, raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(ROWS, -1), None


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[Path, dict[str, tuple[np.ndarray, np.ndarray | None]]]:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    made = {}
    for kind in SUPPORTED_TYPES:
        raw, src = _raw_blocks(kind, rng)
        made[kind] = (raw, src)
        writer.add_tensor(kind, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, made


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_dequantize_matches_the_gguf_reference(gguf_file, kind):
    path, made = gguf_file
    raw, src = made[kind]
    [tensor] = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == kind]
    got = dequantize_tensor(tensor)
    assert got.shape == (ROWS, COLS) and got.dtype == np.float32
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(ROWS, COLS)
    np.testing.assert_array_equal(got, reference.astype(np.float32))
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    if src is not None:  # the floats survive quantization within its error
        tol = {"F32": 0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2}.get(kind, 0.35)
        np.testing.assert_allclose(got, src, atol=tol * np.abs(src).max())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_matches_transformers_independent_dequantizer(gguf_file, kind):
    hf = pytest.importorskip("transformers.integrations.gguf.dequant")
    path, made = gguf_file
    raw, _ = made[kind]
    [tensor] = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == kind]
    ref = hf.dequantize(torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1),
                        int(gguf.GGMLQuantizationType[kind])).reshape(ROWS, COLS)
    np.testing.assert_allclose(dequantize_tensor(tensor), ref.numpy(), rtol=1e-6, atol=1e-7)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_and_matches_transformers(n_head):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(n_head).standard_normal((n_head * 8, 5)).astype(np.float32)
    stored = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(stored, w)
    np.testing.assert_array_equal(unpermute_qk(stored, n_head), w)
    proc = LlamaTensorProcessor(config={"num_attention_heads": n_head, "num_key_value_heads": n_head})
    np.testing.assert_array_equal(proc._reverse_permute_weights(stored, n_head, n_head), w)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 18 * 2), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [tensor] = gguf.GGUFReader(str(path)).tensors
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has unsupported GGUF type IQ4_NL"):
        dequantize_tensor(tensor)


def test_config_from_metadata_and_errors():
    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.block_count": 2,
            "qwen2.feed_forward_length": 128, "qwen2.attention.head_count": 4,
            "qwen2.attention.head_count_kv": 2, "qwen2.context_length": 4096,
            "qwen2.rope.freq_base": 1e6, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
            "tokenizer.ggml.tokens": ["a"] * 100, "tokenizer.ggml.eos_token_id": 7,
            "tokenizer.ggml.eot_token_id": 9, "qwen2.rope.scaling.type": "linear",
            "qwen2.rope.scaling.factor": 4.0}
    cfg = hf_config(meta)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["head_dim"] == 16
    assert cfg["vocab_size"] == 100 and cfg["eos_token_id"] == [7, 9] and cfg["rope_theta"] == 1e6
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'"):
        hf_config({"general.architecture": "gemma2"})
    with pytest.raises(ValueError, match="lacks qwen2.block_count"):
        hf_config({k: v for k, v in meta.items() if k != "qwen2.block_count"})
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        hf_config({**meta, "qwen2.rope.scaling.type": "yarn"})
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def _llama_cpp_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                            old: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py: the rope_freqs it writes for Llama 3.1+ scaling."""
    import math

    out = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs():
    factors = _llama_cpp_rope_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192)  # Llama 3.2
    assert llama3_rope_scaling(factors, 500000.0, 64, 8192) == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    other = _llama_cpp_rope_factors(500000.0, 64, 8.0, 2.0, 4.0, 8192)
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_rope_scaling(other, 500000.0, 64, 8192)
