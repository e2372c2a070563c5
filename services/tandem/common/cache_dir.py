"""Where tandem keeps what it makes on first use (the embedded checkpoints, compiled kernels)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


@contextlib.contextmanager
def publishing(out: Path, what: str = "model") -> Iterator[Path]:
    """Write a folder for ``out`` into the yielded temporary folder beside it; on success it
    becomes ``out`` in one rename, readable by every user of a shared cache. Another process
    that published the same folder first wins the race (its copy is kept); any other failure
    to publish raises ``OSError``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():  # mkdtemp and safetensors create private files
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.replace(tmp, out)
        except OSError as e:
            if not (out / "config.json").is_file():  # not a lost race: a real failure
                raise OSError(f"cannot move the {what} into {out}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
