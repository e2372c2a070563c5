"""Builds the native CPU kernels (``csrc/``) with the system C compiler into a shared
library cached under ``$TANDEM_CACHE_DIR/kernels`` (default ``~/.cache/tandem/kernels``),
keyed by the sources, the flags and the CPU, so a machine compiles once."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from tandem.common.cache_dir import cache_dir
from tandem.engine.kernels import cpu_features

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode.c", "paged_prefill.c", "paged_prefill_amx.c", "amx_linear.c",
           "bf16_avx512_linear.c", "fused_ops.c", "int8_linear.c", "gemv.c", "packed_linear.c",
           "argmax.c", "decode_stack.c", "top_candidates.c", "inverse_cdf.c")
HEADERS = ("amx_attention.h", "amx_tiles.h", "kernels.h", "gemv_avx2.h", "packed_avx2.h",
           "pack_panels.h", "silu.h", "vexp.h", "vexp512.h", "team.h", "kv_load.h", "paged_decode_impl.h",
           "paged_prefill_impl.h", "prefill_tasks.h", "prefill_vec.h", "transpose16.h",
           "transpose8.h", "vexp256.h")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC",
         "-shared", "-std=c11"]


def _cpu_id() -> str:
    """The CPU's flags (what ``-march=native`` compiles for), or its name where unknown."""
    return " ".join(sorted(cpu_features.proc_flags())) or platform.processor()


def build(compiler: str) -> Path:
    """The shared library of ``csrc/`` for this compiler and CPU: built once into the
    cache (a compile of every source, too slow to repeat per process), then found there."""
    digest = hashlib.sha256(" ".join([compiler, *FLAGS, _cpu_id()]).encode())
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    target = cache_dir() / "kernels" / f"tandem-kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        compile_to(compiler, Path(tmp))
        os.replace(tmp, target)  # atomic: concurrent workers never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def compile_to(compiler: str, target: Path, march: str = "native",
               sources: tuple[str, ...] = SOURCES) -> Path:
    """Compiles ``sources`` (of ``csrc/``) into the shared library ``target`` for ``march``
    (``-march=``; tests build other instruction sets than this CPU's), uncached."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in FLAGS]
    subprocess.run([compiler, *flags, "-o", str(target), *(str(CSRC / n) for n in sources), "-lm"],
                   check=True, capture_output=True, text=True, timeout=300)
    return target
