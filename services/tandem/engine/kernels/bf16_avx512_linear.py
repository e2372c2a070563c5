"""bf16 linears on AVX-512 (``csrc/bf16_avx512_linear.c``) for CPUs with AVX-512 BF16 but
without AMX tiles (Zen 4, Cooper Lake, Xeons whose AMX the OS withholds).

The weights are packed as for AMX (``amx_linear``: 16-output blocks of input pairs), so
an LM head tied to its embedding table is looked up there as on AMX
(``amx_linear.AmxEmbedding``). A call rounds its fp32 input to bf16 and each output (bias
added) to bf16, as the AMX kernel and oneDNN round them, and sums every output over the
inputs in one order whatever the batch: a row's result does not depend on its batch,
where oneDNN's bf16 sums can. Two kernels compute those sums, one per CPU maker: AMD's
(Zen 4+) on ``vdpbf16ps`` (on a Zen 4, oneDNN's ``vdpbf16ps`` prompts ran faster than
fp32); Intel's on fp32 FMAs over weights widened in registers, since ``vdpbf16ps``
ran slower than the FMAs on the Intel Xeon measured (the same bits, but for denormals,
which ``vdpbf16ps`` flushes; both in services/RESULTS.md).
``TANDEM_BF16_AVX512_KERNEL=dot`` or ``fma`` picks one whatever the maker (every process
of a cluster must see the same). The MLP runs as two products with the SiLU·mul between
(no fused form here).
"""

from __future__ import annotations

import os
from functools import cache

from tandem.engine.kernels import cpu_features, cpu_kernels, kernel_choice
from tandem.engine.kernels.amx_linear import PairPackedKernels


class Bf16Avx512Kernels(PairPackedKernels):
    """Every linear over an AMX-packed bf16 weight, on ``vdpbf16ps`` or (``fma``) on fp32
    FMAs over the widened weights."""

    def __init__(self, kernels: cpu_kernels.CpuKernels, fma: bool) -> None:
        self.fma = fma
        self.name = "AVX-512 bf16 (FMA)" if fma else "AVX-512 bf16 (vdpbf16ps)"
        super().__init__(kernels, "tandem_bf16_fma_linear" if fma else "tandem_bf16_dot_linear")


KERNEL_ENV = "TANDEM_BF16_AVX512_KERNEL"


@cache
def load() -> Bf16Avx512Kernels | None:
    """The kernels where the CPU has AVX-512 BF16 and the native library builds with it
    (FMAs on an Intel CPU, dot products elsewhere, unless ``KERNEL_ENV`` says which); else
    None."""
    if not kernel_choice.avx512_bf16(cpu_features.cpu_flags()):
        return None
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.lib.tandem_bf16_avx512_supported():
        return None
    chosen = os.environ.get(KERNEL_ENV, "").strip()
    if chosen not in ("", "dot", "fma"):
        raise ValueError(f"{KERNEL_ENV} must be dot or fma, not {chosen!r}")
    fma = chosen == "fma" if chosen else cpu_features.cpu_vendor() == "GenuineIntel"
    return Bf16Avx512Kernels(kernels, fma=fma)
