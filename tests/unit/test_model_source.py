"""What ``tandem serve MODEL`` / ``LLM(MODEL)`` accept, resolved without reaching the hub:
a folder, a hub repo id from a pre-filled hub cache, and clear errors otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem.engine.model_source import resolve_model


@pytest.fixture
def offline_hub(monkeypatch, tmp_path) -> Path:
    """An empty hub cache with the hub switched off (no request leaves the machine)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_folder_is_served_under_its_name(tiny_model_dir):
    resolved = resolve_model(str(tiny_model_dir))
    assert resolved.path == Path(tiny_model_dir) and resolved.name == Path(tiny_model_dir).name


def test_a_repo_id_resolves_from_the_hub_cache(offline_hub, tiny_model_dir):
    snapshot = offline_hub / "models--acme--tiny-chat" / "snapshots" / "0123abc"
    shutil.copytree(tiny_model_dir, snapshot)
    (offline_hub / "models--acme--tiny-chat" / "refs").mkdir()
    (offline_hub / "models--acme--tiny-chat" / "refs" / "main").write_text("0123abc")
    resolved = resolve_model("acme/tiny-chat")
    assert resolved.path == snapshot and resolved.name == "acme/tiny-chat"
    assert (resolved.path / "config.json").is_file()


def test_a_repo_id_offline_and_not_cached_is_a_clear_error(offline_hub):
    with pytest.raises(ValueError, match=r"cannot fetch 'acme/missing': the Hugging Face hub is unreachable"):
        resolve_model("acme/missing")


@pytest.mark.parametrize("spec", ["./nowhere", "/no/such/model.gguf", "not a model"])
def test_missing_paths_are_named(spec):
    with pytest.raises(FileNotFoundError, match="model not found"):
        resolve_model(spec)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="neither a model folder nor a GGUF file"):
        resolve_model(str(bogus))


def test_a_folder_without_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
