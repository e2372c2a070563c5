"""CPU instruction-set features the engine picks its fast paths by, read once at start-up."""

from __future__ import annotations

import os
from functools import cache

from tandem.engine.kernels import kernel_choice


@cache
def proc_flags() -> frozenset[str]:
    """The ``flags`` of /proc/cpuinfo's first processor (empty where it cannot be read):
    what ``-march=native`` compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def hidden_flags() -> frozenset[str]:
    """The flags named in ``TANDEM_CPU_FLAGS_OFF`` (comma-separated)."""
    return frozenset(f.strip() for f in os.environ.get("TANDEM_CPU_FLAGS_OFF", "").split(",") if f.strip())


@cache
def cpu_flags() -> frozenset[str]:
    """The flags the engine picks its paths by: ``proc_flags`` less ``hidden_flags`` (the
    engine then takes the paths of a CPU without them, e.g. ``amx_bf16`` for one without
    AMX; the native kernels are still compiled for this CPU)."""
    return proc_flags() - hidden_flags()


@cache
def cpu_vendor() -> str:
    """The ``vendor_id`` of /proc/cpuinfo (GenuineIntel, AuthenticAMD; empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bf16 products natively (else oneDNN would emulate them)."""
    return kernel_choice.native_bf16(cpu_flags() if flags is None else flags)


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has AMX bf16 tiles (Sapphire Rapids+), on which torch's bf16
    attention kernel runs its products, and the OS lets this process use them."""
    if not kernel_choice.amx_tiles(cpu_flags() if flags is None else flags):
        return False
    import torch

    usable = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return usable is None or bool(usable())


def vector_isa(flags: frozenset[str] | None = None) -> str:
    """The widest vector instruction set that picks the engine's CPU paths, as a benchmark
    reports its CPU: AMX or AVX-512 BF16 (native bf16 products), AVX-512 or AVX2 (the native
    kernels' builds), else "no AVX2"."""
    flags = cpu_flags() if flags is None else flags
    for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "no AVX2"
