"""The layer-truncated draft model (``tandem draft truncate``) and the draft's cost in the
adaptive policy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tandem.cli.main import main as cli_main
from tandem.common.config import SpeculativeConfig
from tandem.engine.model.config import ModelConfig
from tandem.engine.spec.draft_model import decode_weights
from tandem.engine.spec.speculator import Speculator
from tandem.engine.spec.truncated_draft import truncated_draft_path, write_truncated_draft


def _tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_truncated_draft_keeps_the_first_layers_norm_and_head(tiny_model_dir, tmp_path):
    target = ModelConfig.from_dir(tiny_model_dir)
    assert target.num_layers == 2
    out = write_truncated_draft(tiny_model_dir, 1, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    assert cfg["tandem_draft"] == {"kind": "layer-truncated", "source": str(tiny_model_dir.resolve()),
                                   "source_layers": 2, "layers": 1}
    full, draft = _tensors(tiny_model_dir), _tensors(out)
    assert set(draft) == {k for k in full if not k.startswith("model.layers.1.")}
    assert all(torch.equal(draft[k], full[k]) for k in draft)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    mc = ModelConfig.from_dir(out)
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers) == (target.vocab_size, target.hidden_size, 1)


@pytest.mark.parametrize("layers", [0, 2, -1])
def test_a_draft_keeps_at_least_one_and_fewer_than_all_layers(tiny_model_dir, tmp_path, layers):
    with pytest.raises(ValueError, match="keeps 1 to 1 of the target's 2 layers"):
        write_truncated_draft(tiny_model_dir, layers, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_an_existing_model_folder_is_not_overwritten(tiny_model_dir, tmp_path):
    write_truncated_draft(tiny_model_dir, 1, tmp_path / "d")
    with pytest.raises(ValueError, match="already holds a model"):
        write_truncated_draft(tiny_model_dir, 1, tmp_path / "d")


def test_the_cached_draft_is_written_once(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    first = truncated_draft_path(tiny_model_dir, 1)
    assert first.is_relative_to(tmp_path) and (first / "config.json").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert truncated_draft_path(tiny_model_dir, 1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_cli_draft_truncate(tiny_model_dir, tmp_path, capsys):
    assert cli_main(["draft", "truncate", "--model", str(tiny_model_dir), "--layers", "1",
                     "--out", str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "d")
    assert ModelConfig.from_dir(tmp_path / "d").num_layers == 1
    assert cli_main(["draft", "truncate", "--model", str(tiny_model_dir), "--layers", "5",
                     "--out", str(tmp_path / "e")]) == 2
    assert "keeps 1 to 1" in capsys.readouterr().err


def test_decode_weights_scale_with_the_layers_kept(tiny_model_dir, tmp_path):
    target = ModelConfig.from_dir(tiny_model_dir)
    draft = ModelConfig.from_dir(write_truncated_draft(tiny_model_dir, 1, tmp_path / "d"))
    head = target.vocab_size * target.hidden_size
    assert decode_weights(draft) - head == (decode_weights(target) - head) // 2


class _CostlyProposer:
    def __init__(self, draft_cost: float) -> None:
        self.draft_cost = draft_cost

    def propose(self, seq_id, token_ids, k):
        return [0] * k

    def drop(self, seq_id):
        pass


def test_the_policy_charges_the_drafts_own_cost():
    """At 50% acceptance, free drafts pay; drafts costing 80% of a decode step do not."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    free, costly = Speculator(config, _CostlyProposer(0.0)), Speculator(config, _CostlyProposer(0.8))
    for spec in (free, costly):
        for _ in range(10):
            spec.observe("s", 2, 1)  # one accepted then a rejection: rate 0.5 per token
    assert free.draft_length("s") == 2
    assert costly.draft_length("s") == 0
    assert Speculator(config).draft_cost == 0.0  # prompt lookup is free
