"""PNG plots of serving-benchmark results (matplotlib, headless ``Agg`` backend).

Each function takes one or more results dicts (``tandem.bench.serve`` output, one per
system) and writes one PNG: latency CDFs, SLO attainment against rate, goodput, and the
combined comparison figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.bench.metrics_math import goodput_text

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end"))
LINESTYLES = ("-", "--", ":", "-.")


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plots need matplotlib: pip install matplotlib (the results JSON is written "
                           "regardless)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(result: dict) -> str:
    return result.get("label") or "server"


def _finite(result: dict) -> list[dict]:
    """The runs at a finite rate (an all-at-once burst has rate None and no place on a rate axis)."""
    return [run for run in result["runs"] if run["rate"] is not None]


def _rates(result: dict) -> list[float]:
    return [run["rate"] for run in _finite(result)]


def _rate_label(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:g}"


def _values_ms(records: Sequence[dict], key: str) -> list[float]:
    if key == "itl_s":
        return sorted(1e3 * g for r in records if r["ok"] for g in r["itl_s"])
    return sorted(1e3 * r[key] for r in records if r["ok"] and r[key] is not None)


def latency_cdfs(results: Sequence[dict], path: str | Path) -> Path:
    """CDFs of TTFT, TPOT, ITL and e2e: a line per system and rate."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, METRICS):
        for color, result in enumerate(results):
            for k, run in enumerate(result["runs"]):
                xs = _values_ms(run["requests"], key)
                if not xs:
                    continue
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", color=f"C{color}", linestyle=LINESTYLES[k % len(LINESTYLES)],
                        label=f"{_label(result)} @ {_rate_label(run['rate'])}/s")
        slo_ms = results[0]["slo"].get({"ttft_s": "ttft_ms", "tpot_s": "tpot_ms"}.get(key, ""), None)
        if slo_ms:
            ax.axvline(slo_ms, color="grey", linewidth=1, linestyle=":", label="SLO")
        ax.set(title=title, xlabel="ms (log scale)", ylim=(0, 1.02),
               ylabel="fraction of token gaps" if key == "itl_s" else "fraction of requests")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("latency CDFs (successful requests)")
    return _save(fig, path)


def _attainment_axes(ax, results: Sequence[dict], detail: bool) -> None:
    target = results[0]["slo"]["attainment"]
    for color, result in enumerate(results):
        rates = _rates(result)
        att = [run["summary"]["attainment"] for run in _finite(result)]
        ax.plot(rates, [a["both"] for a in att], "o-", color=f"C{color}", label=f"{_label(result)}: both")
        if detail:
            ax.plot(rates, [a["ttft"] for a in att], "^:", color=f"C{color}", alpha=0.6, label="TTFT only")
            ax.plot(rates, [a["tpot"] for a in att], "v--", color=f"C{color}", alpha=0.6, label="TPOT only")
        g = result["goodput"]["interpolated_rps"]
        if g:
            ax.axvline(g, color=f"C{color}", linewidth=1, alpha=0.5)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02),
           title="SLO attainment vs rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def attainment_vs_rate(results: Sequence[dict], path: str | Path) -> Path:
    """Share of requests meeting the SLO (both targets, and each alone for one system) per rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    _attainment_axes(ax, results, detail=len(results) == 1)
    return _save(fig, path)


def _goodput_bars(ax, results: Sequence[dict]) -> None:
    names = [_label(r) for r in results]
    vals = [r["goodput"]["interpolated_rps"] for r in results]
    bars = ax.bar(names, vals, color=[f"C{i}" for i in range(len(results))])
    for bar, r in zip(bars, results):
        g = r["goodput"]
        text = goodput_text(g)
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set(ylabel="goodput (req/s)", title=f"goodput at {results[0]['slo']['attainment']:.0%} SLO attainment")
    ax.grid(axis="y", alpha=0.3)


def goodput(results: Sequence[dict], path: str | Path) -> Path:
    """Requests/s meeting the SLO against offered rate, and the goodput (interpolated; + = lower
    bound, < = below the lowest rate swept)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for color, result in enumerate(results):
        good = [run["summary"]["throughput"]["good_requests_per_s"] for run in _finite(result)]
        left.plot(_rates(result), good, "o-", color=f"C{color}", label=_label(result))
    finite = [r for res in results for r in _rates(res)]
    if finite:
        left.plot([0, max(finite)], [0, max(finite)], color="grey", linestyle=":", label="offered")
    left.set(xlabel="request rate (req/s)", ylabel="requests/s meeting the SLO", title="good throughput")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    _goodput_bars(right, results)
    return _save(fig, path)


def compare(results: Sequence[dict], path: str | Path) -> Path:
    """The comparison in one figure: attainment, goodput, p90 TTFT and p90 TPOT against rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    _attainment_axes(axes[0][0], results, detail=False)
    _goodput_bars(axes[0][1], results)
    for ax, key, slo_key, title in ((axes[1][0], "ttft_ms", "ttft_ms", "p90 TTFT"),
                                    (axes[1][1], "tpot_ms", "tpot_ms", "p90 TPOT")):
        for color, result in enumerate(results):
            ys = [run["summary"][key]["p90"] for run in _finite(result)]
            ax.plot(_rates(result), [math.nan if y is None else y for y in ys], "o-", color=f"C{color}",
                    label=_label(result))
        if results[0]["slo"].get(slo_key):
            ax.axhline(results[0]["slo"][slo_key], color="grey", linestyle=":", label="SLO")
        ax.set(xlabel="request rate (req/s)", ylabel="ms", title=f"{title} vs rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(results[0].get("config", {}).get("workload_name") or "comparison")
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
