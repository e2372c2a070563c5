"""Shared fixtures: small checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep torch from oversubscribing the CI machine's two cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded ``tiny`` preset as a Hugging Face folder."""
    from services.engine.default_model import write_model

    return write_model("tiny", tmp_path_factory.mktemp("tiny") / "model")
