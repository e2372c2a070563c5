"""The embedded default model: presets, byte-identical writes, and loadability by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.engine import default_model as dm
from tandem.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dm.write_model("tiny", tmp_path_factory.mktemp("dm") / "tiny")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_presets() -> None:
    P = dm.ModelPreset
    assert dm.PRESETS == {
        "tiny": P(64, 176, 2, 4, 2, 1024, 2048, 10000.0, True),
        "small": P(256, 704, 4, 8, 4, 1024, 4096, 10000.0, True),
        "bench": P(512, 1408, 8, 8, 4, 32000, 4096, 10000.0, False),
    }
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        dm.write_model("huge", "/nonexistent")


def test_write_is_byte_identical(tiny: Path, tmp_path: Path) -> None:
    again = dm.write_model("tiny", tmp_path / "a" / "tiny")
    files = _files(tiny)
    assert set(files) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"}
    assert files == _files(again)
    other = _files(dm.write_model("tiny", tmp_path / "seed1", seed=1))
    assert other["model.safetensors"] != files["model.safetensors"]
    assert other["tokenizer.json"] == files["tokenizer.json"]
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]  # no temp dirs left behind
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in tiny.iterdir()) and tiny.stat().st_mode & 0o777 == 0o755


def test_tokenizer_identical_in_a_fresh_process(tiny: Path) -> None:
    code = "import sys; from tandem.engine.default_model import build_tokenizer; " \
           "sys.stdout.write(build_tokenizer().to_str(pretty=True) + '\\n')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, check=True).stdout
    assert out == (tiny / "tokenizer.json").read_bytes()


def test_files_contents(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["rope_theta"] == 10000.0 == cfg["rope_parameters"]["rope_theta"]
    assert cfg["rope_parameters"]["rope_type"] == "default" and cfg["torch_dtype"] == "float32"
    tok = Tokenizer.from_dir(tiny)
    assert tok.vocab_size == dm.TOKENIZER_VOCAB_SIZE == 1024
    assert [tok.backend.token_to_id(t) for t in dm.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token_ids == {2, 0} and tok.bos_token_id == 0
    assert set(cfg["eos_token_id"]) == set(json.loads((tiny / "generation_config.json").read_text())["eos_token_id"])
    assert tok.is_byte_level and tok.encode("hello")[0] != 0
    weights = load_file(str(tiny / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == dm.tensor_shapes("tiny")
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    assert "lm_head.weight" not in weights  # tied


def test_bench_parameter_count_and_shapes() -> None:
    n = dm.num_parameters("bench")
    assert 55_500_000 < n < 57_000_000, n
    assert "lm_head.weight" in dm.tensor_shapes("bench")
    transformers = pytest.importorskip("transformers")
    config, _, _ = dm._configs(dm.PRESETS["bench"], dm.build_tokenizer())
    config = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    hf_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert hf_shapes == dm.tensor_shapes("bench")
    assert sum(p.numel() for p in model.parameters()) == n


def test_hf_loads_tiny(tiny: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    weights = load_file(str(tiny / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tiny))
    assert len(hf_tok) == 1024
    ids = torch.tensor([hf_tok.encode("The quick brown fox jumps over the lazy dog. def f(x): return x")])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert logits.std() > 1.0 and (gaps > 1e-2).float().mean() > 0.9, gaps  # clear argmaxes, not near-ties
    generated = out[0, ids.shape[1]:].tolist()
    assert len(set(generated)) > 8, generated  # greedy decoding does not collapse onto one token


def test_existing_target_is_kept(tiny: Path, tmp_path: Path) -> None:
    target = tmp_path / "m"
    dm.write_model("tiny", target)
    (target / "config.json").write_text("{}")
    assert dm.write_model("tiny", target, seed=5) == target
    assert (target / "config.json").read_text() == "{}"


def test_concurrent_first_use(tmp_path: Path) -> None:
    target = tmp_path / "race" / "tiny"
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(dm.write_model("tiny", target))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target] * 6
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]
    assert (target / "model.safetensors").is_file()


def test_lost_race_keeps_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: Path) -> None:
    target = tmp_path / "m"
    real = dm.build_tokenizer
    calls: list[int] = []

    def racing():  # another writer finishes while this one is still writing
        if not calls:
            calls.append(1)
            dm.write_model("tiny", target, seed=3)
        return real()

    monkeypatch.setattr(dm, "build_tokenizer", racing)
    assert dm.write_model("tiny", target) == target
    winner = (target / "model.safetensors").read_bytes()
    assert winner != (tiny / "model.safetensors").read_bytes()  # seed 3's, not replaced by seed 0's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_default_model_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = dm.default_model_path("tiny")
    assert path == tmp_path / "models" / "tiny-seed0-v1"
    assert _files(path) == _files(tiny)
    assert dm.default_model_path("tiny") == path
