"""Native kernels built for another instruction set than this CPU's, for tests that
compare the builds."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path
from types import SimpleNamespace

from tandem.engine.kernels import kernel_build


def build_for(tmp_path: Path, march: str, sources: tuple[str, ...]) -> SimpleNamespace:
    """``sources`` of ``csrc/`` compiled for ``-march=march``: an object whose ``lib`` the
    kernel wrappers (``PackedKernels``, ``Int8Kernels``) bind as they bind the loaded one's."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    lib_path = kernel_build.compile_to(compiler, tmp_path / f"{march}.so", march, sources)
    return SimpleNamespace(lib=ctypes.CDLL(str(lib_path)))
