"""Where tandem keeps what it makes on first use (the embedded checkpoints, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
