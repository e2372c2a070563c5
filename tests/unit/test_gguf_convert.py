"""A GGUF written the way llama.cpp writes one (Q/K permuted, tokenizer as metadata) from the
``tiny`` preset converts back into the same weights, config and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from tandem.engine.model.gguf_loader import convert  # noqa: E402
from tandem.text.tokenizer import Tokenizer  # noqa: E402

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_NAMES[module]}.{leaf}"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tok = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [specials.get(i, t) for i, (t, _) in enumerate(vocab)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"][0])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])
    for name, t in sorted(load_file(str(tiny_model_dir / "model.safetensors")).items()):
        a = t.numpy()
        if ".q_proj." in name:
            a = _permute(a, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            a = _permute(a, cfg["num_key_value_heads"])
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_conversion_restores_weights_config_and_tokenizer(tiny_gguf, tiny_model_dir, tmp_path):
    out = convert(tiny_gguf, tmp_path / "converted")
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(converted[name], t), name  # Q/K un-permuted exactly
    want, got = json.loads((tiny_model_dir / "config.json").read_text()), json.loads((out / "config.json").read_text())
    for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                "tie_word_embeddings", "bos_token_id"):
        assert got[key] == want[key], key
    a, b = Tokenizer.from_dir(tiny_model_dir), Tokenizer.from_dir(out)
    for text in ["Hello world, the model 1234!", "def f(x):\n    return x", "héllo wörld 🎉",
                 "<|im_start|>user\nhi<|im_end|>"]:
        assert b.encode(text) == a.encode(text), text
        assert b.decode(b.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "hi"}]
    assert b.encode_chat(chat) == a.encode_chat(chat)
    assert 2 in b.eos_token_ids  # <|im_end|>


def test_converting_twice_keeps_the_first_folder(tiny_gguf, tmp_path):
    out = convert(tiny_gguf, tmp_path / "c")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert(tiny_gguf, tmp_path / "c") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        convert(bad, tmp_path / "out")


def test_llm_loads_a_gguf_path_like_its_source_folder(tiny_gguf, tiny_model_dir, tmp_path, monkeypatch):
    from tandem.common.sampling_params import SamplingParams
    from tandem.engine import LLM
    from tandem.engine.model_source import resolve_model

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    resolved = resolve_model(str(tiny_gguf))
    assert resolved.name == "tiny" and resolved.path.is_relative_to(tmp_path / "models" / "gguf")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    from_gguf = LLM(str(tiny_gguf)).generate(["Hello world", "def f(x):"], params)
    from_folder = LLM(str(tiny_model_dir)).generate(["Hello world", "def f(x):"], params)
    assert [o.outputs[0].token_ids for o in from_gguf] == [o.outputs[0].token_ids for o in from_folder]
    assert [o.prompt_token_ids for o in from_gguf] == [o.prompt_token_ids for o in from_folder]


def test_a_reinstalled_file_reuses_its_conversion_and_a_changed_one_converts_anew(tiny_gguf, tmp_path,
                                                                                  monkeypatch):
    import os
    import shutil

    from tandem.engine.model.gguf_loader import converted_path

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    first = converted_path(tiny_gguf)
    again = tmp_path / "reinstalled" / tiny_gguf.name  # a new path and modification time
    again.parent.mkdir()
    shutil.copyfile(tiny_gguf, again)
    os.utime(again, ns=(1, 1))
    assert converted_path(again) == first
    changed = tmp_path / "changed" / tiny_gguf.name
    changed.parent.mkdir()
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor's data
    changed.write_bytes(bytes(data))
    assert converted_path(changed) != first
    assert sorted(p.name for p in (tmp_path / "cache" / "models" / "gguf").iterdir()
                  if p.name != "content-keys") == sorted({first.name, converted_path(changed).name})
