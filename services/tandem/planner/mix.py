"""The pool layouts `tandem plan` weighs: a mix of prefill and decode workers, and its
mode (``disaggregated``, ``conditional`` or ``colocated``), as `tandem serve` runs it."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from tandem.planner.cpu_share import Hardware
from tandem.cluster import cpu_sizing
from tandem.common.config import LOCAL_PREFILL_THRESHOLD, PREFILL_SATURATION_S, ClusterConfig
from tandem.router.config import COLOCATED, CONDITIONAL, DISAGGREGATED

_MIX = re.compile(r"^(?:(\d+)P\+(\d+)D(-conditional)?|colocated[x×*](\d+))$", re.IGNORECASE)


@dataclass(frozen=True)
class Mix:
    """A pool layout: ``prefill`` + ``decode`` workers, or ``decode`` colocated workers.
    ``conditional``: disaggregated, but short prompts prefill on the decode worker."""

    prefill: int
    decode: int
    colocated: bool = False
    conditional: bool = False

    def __post_init__(self) -> None:
        if self.colocated and self.conditional:
            raise ValueError("a mix is colocated or conditional, not both")

    def bursts(self, hw: Hardware, profiled: int) -> Hardware:
        """``hw`` with the burst threads ``tandem serve`` gives this mix's pools on one host
        (``tandem.cluster.cpu_sizing``), kept where they are the ``profiled`` burst count
        (0: none profiled) and dropped elsewhere."""
        if self.colocated or not profiled or not math.isfinite(hw.cores):
            return dataclasses.replace(hw, decode_burst_threads=0, prefill_burst_threads=0)
        sized = cpu_sizing.resolve(ClusterConfig(mode=self.mode, prefill_workers=self.prefill,
                                                 decode_workers=self.decode, threads_per_worker=hw.threads),
                                   int(hw.cores))
        return dataclasses.replace(
            hw, decode_burst_threads=sized.decode_burst_threads if sized.decode_burst_threads == profiled else 0,
            prefill_burst_threads=sized.prefill_burst_threads if sized.prefill_burst_threads == profiled else 0)

    @property
    def workers(self) -> int:
        return self.decode + (0 if self.colocated else self.prefill)

    @property
    def mode(self) -> str:
        """The `tandem serve --mode` that runs it."""
        return COLOCATED if self.colocated else CONDITIONAL if self.conditional else DISAGGREGATED

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated×{self.decode}"
        return f"{self.prefill}P+{self.decode}D" + ("-conditional" if self.conditional else "")

    @classmethod
    def parse(cls, text: str) -> Mix:
        """``2P+1D`` | ``2P+1D-conditional`` | ``colocated×3`` (or ``colocatedx3``); ValueError otherwise."""
        m = _MIX.match(text.strip())
        counts = (m.group(1), m.group(2), m.group(4)) if m else ()
        if not m or any(g is not None and int(g) < 1 for g in counts):
            raise ValueError(f"a mix is xP+yD, xP+yD-conditional or colocatedxN with x, y, N >= 1, got {text!r}")
        if m.group(4):
            return cls(0, int(m.group(4)), True)
        return cls(int(m.group(1)), int(m.group(2)), conditional=m.group(3) is not None)


def all_mixes(max_workers: int) -> list[Mix]:
    """Every colocated, disaggregated and conditional mix of at most ``max_workers`` workers,
    smallest first."""
    out = [Mix(0, n, True) for n in range(1, max_workers + 1)]
    out += [Mix(p, d, conditional=c) for total in range(2, max_workers + 1) for p in range(1, total)
            for d in [total - p] for c in (False, True)]
    return sorted(out, key=lambda m: (m.workers, m.colocated, -m.prefill, m.conditional))


def conditional_args(mix: Mix, local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD,
                     prefill_saturation_s: float = PREFILL_SATURATION_S,
                     defaults_too: bool = False) -> list[str]:
    """`tandem serve` flags for a conditional mix's router settings (none for other mixes):
    those not at serve's defaults, or with ``defaults_too`` all of them."""
    if not mix.conditional:
        return []
    out: list[str] = []
    if defaults_too or local_prefill_threshold != LOCAL_PREFILL_THRESHOLD:
        out += ["--local-prefill-threshold", str(local_prefill_threshold)]
    if defaults_too or prefill_saturation_s != PREFILL_SATURATION_S:
        out += ["--prefill-saturation-s", f"{prefill_saturation_s:g}"]
    return out


def helm_values(mix: Mix, note: str, layouts: dict[str, str] | None = None,
                local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD,
                threads: int | None = None,
                prefill_saturation_s: float = PREFILL_SATURATION_S) -> str:
    """A values fragment for helm/tandem: the mode and the two worker groups' replicas (one
    worker per pod), their CPU weight layouts when ``layouts`` (the profile's) says, a
    conditional mix's router settings where they are not `tandem serve`'s defaults, and with
    ``threads`` (CPU workers) each pod's CPU request, which its worker runs as torch threads."""
    cpus = f'  resources:\n    requests:\n      cpu: "{threads}"\n' if threads else ""
    prefill_layout = f"  weightLayout: {layouts['prefill']}\n" if layouts else ""
    decode_layout = f"  weightLayout: {layouts['colocated' if mix.colocated else 'decode']}\n" if layouts else ""
    args = conditional_args(mix, local_prefill_threshold, prefill_saturation_s)
    router = ("  extraArgs: [" + ", ".join(f'"{a}"' for a in args) + "]\n") if args else ""
    return (f"# {note}\n"
            f"gateway:\n  mode: {mix.mode}\n{router}"
            f"prefill:\n  replicas: {0 if mix.colocated else mix.prefill}\n  workersPerPod: 1\n{prefill_layout}{cpus}"
            f"decode:\n  replicas: {mix.decode}\n  workersPerPod: 1\n{decode_layout}{cpus}")
