"""Running the engine as a CPU of another class: flags hidden by ``TANDEM_CPU_FLAGS_OFF``
(read by ``cpu_features.cpu_flags``), and the kernel loaders that read them asked again."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.engine.kernels import amx_linear, bf16_avx512_linear, cpu_features, packed_linear
from tandem.engine.kernels.kernel_choice import CLASSES

AMX_FLAGS = tuple(sorted(CLASSES["avx512-amx"] - CLASSES["avx512-bf16"]))
_FLAG_CACHES = (cpu_features.cpu_flags, amx_linear.load, bf16_avx512_linear.load, packed_linear.load)


def forget_flags() -> None:
    """Clear what was decided from the flags seen so far."""
    for f in _FLAG_CACHES:
        f.cache_clear()


@contextmanager
def hidden_cpu_flags(*flags: str, reported: frozenset[str] | None = None) -> Iterator[frozenset[str]]:
    """Run the engine as on this CPU without ``flags``; yields the flags it then sees.
    ``reported``: as on a CPU whose /proc/cpuinfo reports these flags instead (the rule
    only: the native kernels stay built for this one)."""
    before = os.environ.get("TANDEM_CPU_FLAGS_OFF")
    proc_flags = cpu_features.proc_flags
    os.environ["TANDEM_CPU_FLAGS_OFF"] = ",".join(sorted(flags))
    if reported is not None:
        cpu_features.proc_flags = lambda: reported
    forget_flags()
    try:
        yield cpu_features.cpu_flags()
    finally:
        cpu_features.proc_flags = proc_flags
        if before is None:
            del os.environ["TANDEM_CPU_FLAGS_OFF"]
        else:
            os.environ["TANDEM_CPU_FLAGS_OFF"] = before
        forget_flags()
