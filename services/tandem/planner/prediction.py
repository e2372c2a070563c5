"""The plan's prediction of one mix: the profile's fitted steps and engine limits, the
workload's requests, the simulation over a sweep of rates, and the recommended mix."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tandem.bench import serve as serve_bench
from tandem.bench.arrivals import arrival_offsets
from tandem.bench.metrics_math import SLO, goodput, summarize
from tandem.planner.cpu_share import Hardware
from tandem.planner.mix import Mix
from tandem.planner.perf_model import DecodeModel, PrefillModel, StepModel, TransferModel
from tandem.planner.plan_sim import Simulation
from tandem.planner.profile import background_cores
from tandem.planner.sim_worker import Engine, SimRequest
from tandem.router.config import RouterConfig


def quiet_factor(prof: dict[str, Any], threads: int | None = None) -> float:
    """How much faster the profiled steps run on a quiet machine: the share of the cores the
    profiled worker's threads (``threads``; default the profile's per worker) got next to
    the cores other processes used meanwhile."""
    if str(prof["hardware"].get("device", "cpu")).startswith("cuda"):
        return 1.0  # other processes' CPU threads do not slow a GPU step down
    bg = background_cores(prof) or 0.0
    threads = threads or prof["worker"]["threads_per_worker"]
    return min(1.0, prof["hardware"]["cores"] / (threads + bg))


def models(prof: dict[str, Any], quiet: bool = True,
           colocated: bool = False) -> tuple[StepModel, TransferModel | None, Engine]:
    """The fitted step and transfer models and the engine limits of a profile: the pools'
    steps, or a colocated worker's (on its own weight layout); ``quiet``: step times scaled
    to a machine without the profile's background load."""
    f, e = prof["fit"], prof["engine"]
    fits = f["colocated"] if colocated else f
    steps = StepModel(PrefillModel.from_json(fits["prefill"]), DecodeModel.from_json(fits["decode"]))
    if quiet:
        steps = steps.scaled(quiet_factor(prof))
    transfer = TransferModel.from_json(f["transfer"]) if "transfer" in f else None
    engine = Engine(e["max_num_batched_tokens"], e["max_num_seqs"], e["block_size"], e["num_blocks"],
                    e["kv_bytes_per_token"])
    return steps, transfer, engine


def burst_models(prof: dict[str, Any], quiet: bool = True) -> tuple[int, tuple[StepModel, StepModel]] | None:
    """The profile's burst threads and steps (``tandem profile --burst-threads``): a bursting
    prefill worker's, then a bursting decode worker's (its prompts on its own layout); None
    when the profile has none. ``quiet`` as in ``models``, for that many threads."""
    b = prof["fit"].get("burst")
    if not b:
        return None
    decode = DecodeModel.from_json(b["decode"])
    pair = (StepModel(PrefillModel.from_json(b["prefill"]), decode),
            StepModel(PrefillModel.from_json(b["local_prefill"]), decode))
    if quiet:
        factor = quiet_factor(prof, b["threads"])
        pair = (pair[0].scaled(factor), pair[1].scaled(factor))
    return b["threads"], pair


def requests_of(args: argparse.Namespace, rate_index: int, rate: float, seed: int) -> list[SimRequest]:
    wl = serve_bench.plan(argparse.Namespace(**{**vars(args), "seed": seed, "tokenizer": None}))
    reqs = wl.requests(rate_index)
    offsets = arrival_offsets(args.arrival, rate, len(reqs), seed, args.burst_size)
    return [SimRequest(t, tuple(r.prompt), r.output_len, r.kind) for r, t in zip(reqs, offsets)]


def simulate(mix: Mix, args: argparse.Namespace, rates: list[float], slo: SLO, prof: dict[str, Any],
             hw: Hardware) -> dict[str, Any]:
    """One mix over the sweep: a results dict shaped like ``tandem bench serve``'s (no per-request list)."""
    quiet = not args.keep_profile_load
    steps, transfer, engine = models(prof, quiet, mix.colocated)
    burst = burst_models(prof, quiet) if bursts_on(args) else None
    hw = mix.bursts(hw, burst[0] if burst else 0)
    # a conditional decode worker's prompts: the profile's prompt steps on the colocated
    # workers' layout, which is the decode pool's unless --decode-weight-layout set another
    local = models(prof, quiet, colocated=True)[0].prefill if mix.conditional else None
    router = RouterConfig(local_prefill_threshold=args.local_prefill_threshold,
                          prefill_saturation_s=args.prefill_saturation_s)
    runs = []
    work: dict[str, dict[str, float]] = {}  # per worker role, over every run: engine steps, their cost
    for k, rate in enumerate(rates):
        records, duration = [], 0.0
        for rep in range(args.repeats):
            sim = Simulation(requests_of(args, k, rate, args.seed + rep), mix=mix, steps=steps, transfer=transfer,
                             engine=engine, hardware=hw, router=router, local_prefill=local,
                             bursts=burst[1] if burst else None)
            res = sim.run(max_time_s=args.max_duration + 10 * args.request_timeout)
            records += res.records
            duration += res.duration_s
            for role, (n, prompt, decode) in res.engine.items():
                w = work.setdefault(role, {"steps": 0, "prefill_s": 0.0, "decode_s": 0.0})
                w["steps"] += n
                w["prefill_s"] += prompt
                w["decode_s"] += decode
        runs.append({"rate": rate, "summary": summarize(records, duration, slo)})
    good = goodput([(r["rate"], r["summary"]["attainment"]["both"]) for r in runs], slo.attainment)
    return {"label": mix.label, "mix": dataclasses.asdict(mix), "workers": mix.workers,
            "cores": mix.workers * hw.threads, "slo": slo.to_json(), "runs": runs, "goodput": good,
            "engine": work, "bursts": {"prefill": hw.prefill_burst_threads, "decode": hw.decode_burst_threads}}


def bursts_on(args: argparse.Namespace) -> bool:
    """Whether pools burst (``--bursts``; unset: yes, unless the plan is for the chart)."""
    return (args.bursts or ("off" if args.helm_values else "auto")) == "auto"


def recommend(results: list[dict[str, Any]], target_rate: float, target: float) -> dict[str, Any] | None:
    """The cheapest result (cores) whose attainment at ``target_rate`` reaches ``target``;
    ties go to the higher goodput, then the higher attainment at ``target_rate``. None when
    no mix meets it."""
    def at_target(r: dict[str, Any]) -> float:
        run = next(x for x in r["runs"] if x["rate"] == target_rate)
        return run["summary"]["attainment"]["both"] or 0.0

    ok = [r for r in results if at_target(r) >= target]
    if not ok:
        return None
    return min(ok, key=lambda r: (r["cores"], -r["goodput"]["interpolated_rps"], -at_target(r), r["label"]))
