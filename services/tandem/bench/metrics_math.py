"""Serving-benchmark arithmetic: per-request latencies, percentiles, SLO attainment, goodput.

Pure functions on plain numbers and record dicts (the same dicts the results JSON holds),
so a saved run can be re-scored. Records carry seconds (``ttft_s``, ``tpot_s``, ``e2e_s``,
``itl_s``); summaries carry milliseconds (``*_ms``).

Definitions (as in vLLM's serving benchmark and DistServe):
- TTFT: first streamed token's arrival minus the request's send time.
- ITL: every gap between two consecutive streamed token chunks.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``: the mean time per output token after the
  first; no value for a one-token output.
- A request meets the SLO when it succeeded, its TTFT <= the TTFT target and its TPOT
  <= the TPOT target (a target of ``None`` always holds; a TPOT of ``None`` holds).
  Failed requests count in the denominator: they miss.
- Goodput (DistServe): the highest request rate at which at least ``target`` of the
  requests meet the SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds (``None``: no target) and the share that must meet them."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment <= 1.0:
            raise ValueError(f"SLO attainment must be in (0, 1], got {self.attainment}")
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SLO {name} must be positive, got {value}")

    def to_json(self) -> dict[str, float | None]:
        ms = lambda s: None if s is None else 1e3 * s  # noqa: E731
        return {"ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s), "attainment": self.attainment}


def percentile(xs: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation (numpy's default); None when empty."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latencies(send_t: float, token_times: Sequence[float], done_t: float,
              output_tokens: int) -> dict[str, Any]:
    """TTFT, ITL gaps, TPOT and e2e (seconds) of one request from its timestamps.

    ``token_times``: arrival of each streamed chunk that carried output (a chunk may
    carry several tokens; ``output_tokens`` is the server-reported count).
    """
    if not token_times:
        return {"ttft_s": None, "itl_s": [], "tpot_s": None, "e2e_s": done_t - send_t}
    ttft = token_times[0] - send_t
    e2e = done_t - send_t
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"ttft_s": ttft, "itl_s": itl, "tpot_s": tpot, "e2e_s": e2e}


def meets(rec: Mapping[str, Any], slo: SLO, which: str = "both") -> bool:
    """Whether one record meets the SLO (``which``: both | ttft | tpot)."""
    if not rec.get("ok"):
        return False
    ttft_ok = slo.ttft_s is None or (rec.get("ttft_s") is not None and rec["ttft_s"] <= slo.ttft_s)
    tpot_ok = slo.tpot_s is None or rec.get("tpot_s") is None or rec["tpot_s"] <= slo.tpot_s
    return {"both": ttft_ok and tpot_ok, "ttft": ttft_ok, "tpot": tpot_ok}[which]


def attainment(records: Sequence[Mapping[str, Any]], slo: SLO) -> dict[str, float | None]:
    """Share of all requests (failures included) meeting both targets, TTFT only, TPOT only."""
    n = len(records)
    if n == 0:
        return {"both": None, "ttft": None, "tpot": None}
    return {w: sum(meets(r, slo, w) for r in records) / n for w in ("both", "ttft", "tpot")}


def _stats_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    xs = [1e3 * v for v in values_s if v is not None]
    out: dict[str, float | None] = {f"p{q}": percentile(xs, q) for q in PERCENTILES}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["count"] = len(xs)
    return out


def summarize(records: Sequence[Mapping[str, Any]], duration_s: float, slo: SLO) -> dict[str, Any]:
    """Counts, errors by kind, latency percentiles (ms), throughput and SLO attainment of one run.

    Requests the run's time budget cut before they were sent (``sent: false``) are counted
    as ``not_sent`` and left out of everything else: the server never saw them.
    """
    not_sent = sum(1 for r in records if r.get("sent") is False)
    records = [r for r in records if r.get("sent") is not False]
    ok = [r for r in records if r.get("ok")]
    errors = Counter(r["error"] for r in records if not r.get("ok"))
    out_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    in_tokens = sum(r.get("prompt_tokens") or 0 for r in ok)
    att = attainment(records, slo)
    good = sum(meets(r, slo) for r in records)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "requests": len(records), "not_sent": not_sent, "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": duration_s,
        "ttft_ms": _stats_ms(r.get("ttft_s") for r in ok),
        "tpot_ms": _stats_ms(r.get("tpot_s") for r in ok),
        "itl_ms": _stats_ms(g for r in ok for g in r.get("itl_s") or ()),
        "e2e_ms": _stats_ms(r.get("e2e_s") for r in ok),
        "throughput": {"requests_per_s": per_s(len(ok)), "output_tokens_per_s": per_s(out_tokens),
                       "total_tokens_per_s": per_s(out_tokens + in_tokens),
                       "good_requests_per_s": per_s(good)},
        "output_tokens": out_tokens, "prompt_tokens": in_tokens,
        # chunks that brought several tokens at once (their gap is one ITL sample, as in vLLM)
        "multi_token_chunks": sum(r.get("multi_token_chunks") or 0 for r in ok),
        # successful requests whose output length differs from the one asked for
        "output_len_mismatches": sum(1 for r in ok if r.get("expected_output_tokens") is not None
                                     and r.get("output_tokens") != r["expected_output_tokens"]),
        "attainment": att,
        "by_kind": {kind: _kind_stats([r for r in records if r.get("kind") == kind], slo)
                    for kind in sorted({r.get("kind") for r in records if r.get("kind")})},
    }


def _kind_stats(records: Sequence[Mapping[str, Any]], slo: SLO) -> dict[str, Any]:
    ok = [r for r in records if r.get("ok")]
    return {"requests": len(records), "completed": len(ok),
            "ttft_ms": _stats_ms(r.get("ttft_s") for r in ok), "tpot_ms": _stats_ms(r.get("tpot_s") for r in ok),
            "attainment": attainment(records, slo)}


def goodput(points: Sequence[tuple[float, float | None]], target: float) -> dict[str, Any]:
    """Goodput from ``(rate, attainment)`` points of a sweep.

    ``rps``: the highest swept rate such that it and every lower swept rate reach
    ``target`` (0.0 when the lowest does not). ``interpolated_rps``: where the
    attainment curve crosses ``target`` between the last passing and the first failing
    rate (linear), else ``rps``. ``bounded``: False when every rate passed (the true
    goodput is at least ``rps``: sweep higher). ``below_sweep``: True when the lowest
    rate missed (the true goodput is below it, not necessarily 0: sweep lower).
    Infinite rates (bursts) are skipped.
    """
    pts = sorted((r, a) for r, a in points if r is not None and math.isfinite(r))
    best, interp, bounded = 0.0, 0.0, False
    prev: tuple[float, float] | None = None
    for rate, att in pts:
        if att is not None and att >= target:
            best = interp = rate
            prev = (rate, att)
            continue
        bounded = True
        if prev is not None and att is not None:
            (r0, a0), (r1, a1) = prev, (rate, att)
            interp = r0 + (r1 - r0) * (a0 - target) / (a0 - a1) if a0 != a1 else r0
        break
    below = bool(pts) and (pts[0][1] is None or pts[0][1] < target)
    return {"rps": best, "interpolated_rps": interp, "bounded": bounded and bool(pts),
            "below_sweep": below, "target": target, "points": [[r, a] for r, a in pts]}


def goodput_text(g: Mapping[str, Any]) -> str:
    """A ``goodput`` result as printed: "2.50", "6.00+" (every rate met the SLO: a lower
    bound), "<0.50" (the lowest rate swept missed it: an upper bound)."""
    if g["below_sweep"]:
        return f"<{g['points'][0][0]:.2f}"
    return f"{g['interpolated_rps']:.2f}" + ("" if g["bounded"] else "+")


def lstsq_nonneg(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (columns of a negative fit dropped, refitted)."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(a.shape[1])
            out[keep] = np.maximum(coef, 0.0)
            return out
        keep.pop(int(np.argmin(coef)))
