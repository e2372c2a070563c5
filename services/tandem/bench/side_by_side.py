"""tandem's engine against vLLM's ``LLM``, interleaved, on the same prompts and cores.

Each engine is a long-lived side process (``side_protocol``): loaded once, warmed up
with one uncounted round, then measured alternately, tandem first in odd rounds and
vLLM first in even ones (A B B A ...), so a load that drifts during the run weighs on
both alike. A round gives both sides the same fresh prompts (same token ids and
lengths, greedy, EOS ignored; no prefix caching on either side), so no run reuses what
an earlier one cached. Only one side computes at a time: the other waits on its stdin.

Why long-lived sides rather than a fresh process per run: vLLM is slow to start on a
few cores, and the caches a fresh process would clear are the CPU's, which a run over
hundreds of MB of weights refills anyway.

Reported per workload: each side's runs (min / median / max) and the ratio of the
medians, as "tandem's speed ÷ vLLM's" (> 1: tandem faster), for output tokens/s and
for the time to first token of single long prompts. A round times each prompt length
``ttft_repeats`` times per side, alternating (A B B A ...), and keeps each side's best:
one short call is the measure most at the mercy of a noisy neighbour.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.cpu_load import wait_until_idle
from tandem.bench.side_protocol import Side, SideError
from tandem.common.config import EngineConfig
from tandem.engine.progress import bar, spinner

REPO_ROOT = Path(__file__).resolve().parents[2]
LOAD_TIMEOUT_S = 1200.0
RUN_TIMEOUT_S = 900.0


@dataclass
class Plan:
    """What to measure; both sides get exactly these prompts."""

    model: str
    threads: int
    num_prompts: int
    input_len: int
    output_len: int
    ttft_lens: list[int]
    runs: int
    seed: int
    max_model_len: int
    max_num_batched_tokens: int = 4096
    onednn: bool = True
    cpu_kernels: bool = True
    dtype: str = "float32"  # both sides
    weight_layout: str = EngineConfig.cpu_weight_layout  # tandem's CPU weight layout
    ttft_repeats: int = 3  # TTFT calls per side, length and round, alternating; the best counts
    temperature: float = 0.0  # every request's, both sides (0: greedy)
    top_p: float = 1.0


@dataclass
class Series:
    """One workload's measurements, per side, in run order (a value each: higher is better)."""

    name: str
    unit: str
    values: dict[str, list[float]] = field(default_factory=lambda: {"tandem": [], "vllm": []})

    def summary(self) -> dict[str, Any]:
        """min / median / max per side, the ratio of medians, and the per-round ratios."""
        out: dict[str, Any] = {"unit": self.unit}
        for side, vals in self.values.items():
            out[side] = {"runs": vals, "min": min(vals), "median": statistics.median(vals),
                         "max": max(vals)}
        pairs = [t / v for t, v in zip(self.values["tandem"], self.values["vllm"])]
        out["ratio_of_medians"] = out["tandem"]["median"] / out["vllm"]["median"]
        out["round_ratios"] = pairs
        return out


def cpu_list(threads: int) -> str:
    """The first ``threads`` CPUs this process may run on, as vLLM's bind list (``0,1``)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    if threads > len(cpus):
        raise ValueError(f"--threads {threads} but only {len(cpus)} CPUs are usable here")
    return ",".join(str(c) for c in cpus[:threads])


def side_env(threads: int, vllm: bool, kv_cache_gb: float) -> dict[str, str]:
    """The environment of a side: this repository importable, the same thread count."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(threads)
    env["HF_HUB_OFFLINE"] = "1"
    if vllm:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(threads)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gb:g}"
        # One engine step may take minutes on an oversubscribed host; the driver's own
        # RUN_TIMEOUT_S bounds a run instead of vLLM's 300 s step watchdog.
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(int(RUN_TIMEOUT_S)))
    return env


def sampling_label(temperature: float, top_p: float) -> str:
    """How every request samples, as the reports print it."""
    return "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}, top-p {top_p:g}"


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def start_sides(plan: Plan, vllm_python: str, kv_cache_gb: float, log_dir: str) -> dict[str, Side]:
    """Start and load both sides (one after the other, so neither loads under the other)."""
    sides: dict[str, Side] = {}
    try:
        for name, python, module in (("tandem", sys.executable, "tandem.bench.tandem_side"),
                                     ("vllm", vllm_python, "tandem.bench.vllm_side")):
            side = Side(name, [python, "-m", module], side_env(plan.threads, name == "vllm", kv_cache_gb),
                        str(Path(log_dir) / f"{name}.log"))
            sides[name] = side
            extra = {"onednn": plan.onednn, "cpu_kernels": plan.cpu_kernels,
                     "weight_layout": plan.weight_layout} if name == "tandem" else {}
            side.info = side.call("load", LOAD_TIMEOUT_S, model=plan.model, threads=plan.threads,
                                  max_model_len=plan.max_model_len,
                                  max_num_batched_tokens=plan.max_num_batched_tokens,
                                  seed=plan.seed, dtype=plan.dtype, temperature=plan.temperature,
                                  top_p=plan.top_p, **extra)["info"]
    except BaseException:
        for side in sides.values():
            side.close()
        raise
    return sides


def run(plan: Plan, vllm_python: str, vocab: int, kv_cache_gb: float = 2.0,
        progress: Any = print) -> dict[str, Any]:
    """Load both sides, run one warm-up round and ``plan.runs`` measured rounds; the results."""
    log_dir = tempfile.mkdtemp(prefix="tandem-bench-sides-")
    with spinner("offline: loading tandem and vLLM"):
        sides = start_sides(plan, vllm_python, kv_cache_gb, log_dir)
    rng = random.Random(plan.seed)
    throughput = Series("throughput", "output tok/s")
    ttft = {n: Series(f"ttft_{n}", "1/s") for n in plan.ttft_lens}
    order: list[str] = []
    agree = total = 0
    stopped: str | None = None
    settle = {name: 0.0 for name in sides}  # longest wait for a side to go idle after its call
    calls = (plan.runs + 1) * len(sides) * (1 + len(plan.ttft_lens) * plan.ttft_repeats)
    shown = bar(calls, desc="offline: rounds", unit="call")  # on a terminal only

    def measured(name: str, op: str, **fields: Any) -> dict[str, Any]:
        # vLLM's engine keeps a core busy polling for a while after each request:
        # the other side waits for it, so neither is measured against the other's leftovers.
        for other, side in sides.items():
            if other != name:
                settle[other] = max(settle[other], wait_until_idle(side.pid))
        reply = sides[name].call(op, RUN_TIMEOUT_S, **fields)
        shown.update()
        return reply

    try:
        for rnd in range(plan.runs + 1):  # round 0 warms both sides up and is not counted
            names = ["tandem", "vllm"] if rnd % 2 else ["vllm", "tandem"]
            shown.set_postfix(f"round {rnd} of {plan.runs}" + (" (warm-up)" if not rnd else ""))
            prompts = _prompts(rng, plan.num_prompts, plan.input_len, vocab)
            long_prompts = {n: _prompts(rng, 1, n, vocab)[0] for n in plan.ttft_lens}
            tokens: dict[str, list[list[int]]] = {}
            tput: dict[str, float] = {}
            secs: dict[int, dict[str, float]] = {n: {} for n in plan.ttft_lens}
            try:
                for name in names:
                    reply = measured(name, "generate", prompts=prompts, output_len=plan.output_len)
                    tokens[name] = reply["tokens"]
                    tput[name] = plan.num_prompts * plan.output_len / reply["elapsed_s"]
                    progress(f"  round {rnd}{' (warm-up)' if not rnd else ''}: {name:6s} "
                             f"{tput[name]:8.1f} output tok/s")
                for n, prompt in long_prompts.items():
                    for k in range(plan.ttft_repeats):
                        for name in names if k % 2 == 0 else names[::-1]:
                            took = measured(name, "ttft", prompt=prompt)["elapsed_s"]
                            secs[n][name] = min(took, secs[n].get(name, took))
                    progress(f"  round {rnd}: TTFT {n:5d} tokens, best of {plan.ttft_repeats}: " + ", ".join(
                        f"{name} {secs[n][name] * 1e3:.1f} ms" for name in names))
            except SideError as e:
                if rnd <= 1:
                    raise  # not one whole measured round: nothing to report
                stopped = f"stopped after {rnd - 1} of {plan.runs} rounds: {e}"
                break
            if rnd:  # only whole rounds count, so every ratio compares the same prompts
                order += names
                for name in names:
                    throughput.values[name].append(tput[name])
                    for n in plan.ttft_lens:
                        ttft[n].values[name].append(1.0 / secs[n][name])
                agree += sum(a == b for a, b in zip(tokens["tandem"], tokens["vllm"]))
                total += plan.num_prompts
    finally:
        shown.close()
        for side in sides.values():
            side.close()
    return {"sides": {name: side.info for name, side in sides.items()}, "order": order,
            "throughput": throughput.summary(),
            "ttft": {str(n): _ttft_summary(s) for n, s in ttft.items()},
            "greedy_identical": agree, "greedy_total": total, "logs": log_dir,
            "rounds": len(order) // 2, "stopped": stopped, "settle_s": settle}


def _ttft_summary(series: Series) -> dict[str, Any]:
    """A TTFT series summarized in seconds (lower is better) and its ratio as speeds."""
    s = series.summary()
    out: dict[str, Any] = {"ratio_of_medians": s["ratio_of_medians"], "round_ratios": s["round_ratios"]}
    for side in ("tandem", "vllm"):
        secs = sorted(1.0 / v for v in series.values[side])
        out[side] = {"runs_s": [1.0 / v for v in series.values[side]], "min_s": secs[0],
                     "median_s": statistics.median(secs), "max_s": secs[-1]}
    return out


def report(result: dict[str, Any], plan: Plan) -> list[str]:
    """The printed summary lines."""
    t = result["throughput"]
    engine = result["sides"]["vllm"].get("engine", "vllm")
    lines = [f"tandem vs {engine}: {result['rounds']} interleaved runs each, "
             f"{plan.threads} threads, {plan.dtype}, {plan.num_prompts} prompts x ({plan.input_len} in, "
             f"{plan.output_len} out), {sampling_label(plan.temperature, plan.top_p)}"]
    for side in ("tandem", "vllm"):
        lines.append(f"  {side:6s} output tok/s  median {t[side]['median']:8.1f}  "
                     f"(min {t[side]['min']:.1f}, max {t[side]['max']:.1f})")
    same = (f"greedy outputs identical {result['greedy_identical']}/{result['greedy_total']}"
            if plan.temperature == 0 else "outputs not compared")
    lines.append(f"  tandem / vllm (medians) {t['ratio_of_medians']:.2f}x; per round "
                 f"{min(t['round_ratios']):.2f}-{max(t['round_ratios']):.2f}x; {same}")
    if result["ttft"]:
        lines.append(f"  TTFT: each round's best of {plan.ttft_repeats} calls per side, then medians over rounds")
    for n, s in result["ttft"].items():
        lines.append(f"  TTFT {int(n):5d} tokens: tandem {s['tandem']['median_s'] * 1e3:8.1f} ms "
                     f"({s['tandem']['min_s'] * 1e3:.0f}-{s['tandem']['max_s'] * 1e3:.0f}), vllm "
                     f"{s['vllm']['median_s'] * 1e3:8.1f} ms ({s['vllm']['min_s'] * 1e3:.0f}-"
                     f"{s['vllm']['max_s'] * 1e3:.0f}) -> tandem {s['ratio_of_medians']:.2f}x as fast")
    waits = ", ".join(f"{name} {secs:.1f} s" for name, secs in result.get("settle_s", {}).items())
    if waits:
        lines.append(f"  each call waited for the other side to go idle; longest wait after a call: {waits}")
    if result["stopped"]:
        lines.append(f"  INCOMPLETE: {result['stopped']}")
    return lines
