"""Fixtures shared by the cluster, serving and fault tests."""

from __future__ import annotations

import pytest

from tests.hf_models import write_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir) -> str:
    """A random Llama-3 checkpoint (rope scaling, GQA) saved by transformers itself."""
    return str(write_hf_checkpoint("llama3", tmp_path_factory.mktemp("ckpt") / "m", tiny_model_dir))
