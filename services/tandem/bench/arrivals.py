"""Arrival processes: when each request of a run is sent, as offsets (seconds) from its start.

- ``poisson``: exponential gaps with mean ``1/rate`` from a seeded generator; the first
  request at 0. The same seed gives the same unit-rate gaps at every rate (common random
  numbers: the sweep's points differ by the rate only).
- ``constant``: one request every ``1/rate`` seconds.
- ``burst``: groups of ``burst_size`` requests sent together, a group every
  ``burst_size/rate`` seconds (mean rate ``rate``); an infinite rate sends all at 0.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("poisson", "constant", "burst")


def arrival_offsets(kind: str, rate: float, n: int, seed: int = 0,
                    burst_size: int | None = None) -> list[float]:
    """Send offsets (seconds, non-decreasing, the first 0.0) of ``n`` requests at ``rate`` req/s."""
    if kind not in KINDS:
        raise ValueError(f"unknown arrival process {kind!r}; known: {', '.join(KINDS)}")
    if n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be positive (inf allowed), got {rate}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0, n - 1) / rate
        return [0.0] + np.cumsum(gaps).tolist()
    if kind == "constant":
        return [i / rate for i in range(n)]
    size = burst_size or n
    if size < 1:
        raise ValueError(f"burst size must be >= 1, got {size}")
    return [(i // size) * size / rate for i in range(n)]


def parse_rates(text: str) -> list[float]:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]`` (``inf`` allowed); ValueError on anything else."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates takes comma-separated numbers, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates needs positive rates, got {text!r}")
    return rates
