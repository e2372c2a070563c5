"""Which CPU kernel and weight layout the engine picks, by the CPU's flags: the one rule.

The loaders (``packed_linear``, ``amx_linear``, ``bf16_avx512_linear``), ``onednn``'s
storage layout, the attention backend and the model loader (``choose``) all ask these functions, with
``cpu_features.cpu_flags()`` (the CPU's flags less ``TANDEM_CPU_FLAGS_OFF``); the tests ask
them too, so an expectation is never written twice. A loader may still find no kernel (no C
compiler, a library built without the instruction set, the OS not granting AMX tiles): the
rule says what a CPU of these flags takes where the kernels are there.

The CPU classes (``CLASSES``) are the flag sets of the machines the engine is built for;
``choose`` over each is what the per-class tests pin.
"""

from __future__ import annotations

from dataclasses import dataclass

# storage layouts of bf16 weights for the native kernels: AMX's 16 x 32 blocks, or the same
# blocks read by AVX-512 BF16 kernels on a CPU without AMX
AMX, BF16_AVX512 = "amx", "bf16-avx512"

_AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
_AVX512_BF16 = _AVX512 | {"avx512_bf16"}
_AMX = _AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}

# name -> the flags a CPU of that class reports (the ones the rules read, and their kin)
CLASSES: dict[str, frozenset[str]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512-bf16": _AVX512_BF16,
    "avx512-amx": _AMX,
}
# the flags the rules below read: a CPU of a class is one that has these of its flags
RULE_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})


def packed_fp32(flags: frozenset[str]) -> bool:
    """Whether fp32 weights are packed for the native kernel (``csrc/packed_linear.c`` has a
    vector micro-kernel): AVX-512, or AVX2 with FMA. Elsewhere oneDNN's blocked layout."""
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def amx_tiles(flags: frozenset[str]) -> bool:
    """Whether the CPU reports AMX-BF16 tiles (the OS must still grant them to the process)."""
    return "amx_bf16" in flags


def avx512_bf16(flags: frozenset[str]) -> bool:
    """Whether the CPU has AVX-512 BF16 (``vdpbf16ps``), which the BF16_AVX512 kernels need."""
    return "avx512_bf16" in flags


def bf16_layouts(flags: frozenset[str]) -> list[str]:
    """The native layouts packed bf16 weights may take, first choice first: ``AMX`` where
    the CPU has AMX-BF16, then ``BF16_AVX512`` where it has AVX-512 BF16 (taken where the
    OS withholds the tiles, or the AMX kernels do not build). Empty: oneDNN's blocked layout."""
    return [layout for layout, has in ((AMX, amx_tiles(flags)), (BF16_AVX512, avx512_bf16(flags))) if has]


def bf16_weights(flags: frozenset[str]) -> str | None:
    """The native layout packed bf16 weights take where its kernels load (the first of
    ``bf16_layouts``); None: oneDNN's blocked layout."""
    layouts = bf16_layouts(flags)
    return layouts[0] if layouts else None


def native_bf16(flags: frozenset[str]) -> bool:
    """Whether bf16 products run natively (bf16 weights under fp32 activations); without it a
    bf16 model runs wholly in bf16 on torch's path."""
    return bool(bf16_layouts(flags))


def bf16_prompt_attention(flags: frozenset[str]) -> bool:
    """Whether prompts over a bf16 KV cache compute their products in bf16 (on AMX tiles);
    elsewhere they take the fp32 math over the bf16 cache, as decode rows do."""
    return amx_tiles(flags)


@dataclass(frozen=True)
class KernelChoice:
    """What a CPU model of one weight dtype and quantization runs on."""

    linear: str            # "packed" (fp32, native), AMX, BF16_AVX512, "int8", "blocked" (oneDNN), "torch"
    activations: str       # "float32" (bf16 or int8 weights widened per product) or "bfloat16"
    prompt_attention: str  # products of prompts over the KV cache: "bf16" or "fp32"


def choose(flags: frozenset[str], dtype: str = "float32", quantization: str | None = None) -> KernelChoice:
    """The kernels a CPU with ``flags`` runs a model of ``dtype`` (float32 | bfloat16) weights
    and KV on, with ``quantization`` (None | "int8"), where the native kernels build."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"CPU kernels are chosen for float32 or bfloat16, not {dtype!r}")
    prompts = "bf16" if dtype == "bfloat16" and bf16_prompt_attention(flags) else "fp32"
    if quantization == "int8":
        return KernelChoice("int8", "float32", prompts)
    if quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}")
    if dtype == "float32":
        return KernelChoice("packed" if packed_fp32(flags) else "blocked", "float32", prompts)
    if not native_bf16(flags):  # bf16 products emulated: the whole model on torch's bf16 path
        return KernelChoice("torch", "bfloat16", "bf16")
    return KernelChoice(bf16_weights(flags) or "blocked", "float32", prompts)
