"""Everything under tests/gpu needs CUDA: marked ``gpu`` and skipped without a device.

The default ``addopts`` deselect ``gpu`` tests; run them with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session", autouse=True)
def _require_cuda():
    """Session-scoped so it skips before any module fixture tries to touch a device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
