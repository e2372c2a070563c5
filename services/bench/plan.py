"""``tandem plan``: size the pools for a workload and an SLO from a ``tandem profile``.

For every mix within the worker budget (``xP+yD`` disaggregated, ``xP+yD-conditional``:
disaggregated with short prompts prefilled on the decode worker, ``colocated×n``), the
simulator (``services.bench.plan_sim``) serves the workload's request sequence (the same
one ``tandem bench serve`` sends: preset or dataset lengths, arrivals, seeds) at each
rate; the records are scored as a measured run is (``services.bench.metrics_math``:
TTFT/TPOT percentiles, SLO attainment, DistServe goodput). The recommendation is the
cheapest mix (fewest cores: workers x threads) whose attainment at the target rate meets
the SLO; ties go to the higher goodput. Prints a table, writes ``plan.json`` and
``plan.png``, and with ``--helm-values`` the chart's replicas of that mix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from services.bench import runinfo
from services.bench import serve as serve_bench
from services.bench.arrivals import arrival_offsets
from services.bench.metrics_math import SLO, goodput, goodput_text, summarize
from services.bench.mix import Mix, all_mixes, helm_values
from services.bench.perf_model import DecodeModel, PrefillModel, StepModel, TransferModel
from services.bench.cpu_share import Hardware
from services.bench.plan_sim import Simulation
from services.bench.sim_worker import Engine, SimRequest
from services.bench.profile import background_cores
from services.common.config import LOCAL_PREFILL_THRESHOLD, PREFILL_SATURATION_S
from services.router.config import RouterConfig

SCHEMA = "tandem.plan/v1"


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a `tandem profile` JSON")
    p.add_argument("--target-rate", type=float, default=None,
                   help="req/s the recommendation must serve within the SLO (default: the highest of --rates)")
    p.add_argument("--mixes", default=None, help="comma-separated mixes to consider, e.g. 1P+1D,2P+1D,colocatedx2 "
                   "(default: every mix of up to --max-workers workers)")
    p.add_argument("--max-workers", type=int, default=None, help="largest mix (default: twice the cores' worth)")
    p.add_argument("--cores", type=float, default=None, help="cores the workers share (default: the profile's; "
                   "unbounded for a GPU profile, one GPU per worker)")
    p.add_argument("--threads-per-worker", type=int, default=None, help="default: the profile's")
    p.add_argument("--prefill-nice", type=int, default=0, help="as `tandem serve --prefill-nice`")
    p.add_argument("--bursts", choices=("auto", "off"), default=None,
                   help="auto: disaggregated and conditional pools burst as `tandem serve` runs them on one host "
                   "(a decode worker with more threads while no prefill is pending for it, a prefill worker "
                   "while nothing decodes), where the profile timed that many threads (`tandem profile "
                   "--burst-threads`), and `--validate` serves them so; off: fixed threads, as on a Ray "
                   "cluster joined (Kubernetes); with --helm-values, off unless set")
    p.add_argument("--local-prefill-threshold", type=int, default=LOCAL_PREFILL_THRESHOLD,
                   help="conditional mixes: prompts shorter than this prefill on the decode worker (as `tandem "
                   "serve --local-prefill-threshold`)")
    p.add_argument("--prefill-saturation-s", type=float, default=PREFILL_SATURATION_S,
                   help="conditional mixes: a prompt prefills on the decode worker while it would wait longer "
                   "than this on every prefill worker (as `tandem serve --prefill-saturation-s`)")
    p.add_argument("--background-cores", type=float, default=0.0,
                   help="cores other processes keep busy on the workers' host")
    p.add_argument("--keep-profile-load", action="store_true", help="use the profiled step times as measured "
                   "(default: scaled back to a quiet machine from the load other processes put on it meanwhile)")
    p.add_argument("--server-idle-cores", type=float, default=0.08,
                   help="the server's own CPU at rest (load polls, Ray's processes), paid at any rate. 0.08: "
                   "measured by `--validate` on a 2-core x86 host (0.07-0.10 for 2-3 workers)")
    p.add_argument("--frontend-ms-per-token", type=float, default=0.42,
                   help="CPU the request path spends per streamed token outside the engine steps and the idle "
                   "CPU (ms), beyond --frontend-ms-per-step: the gateway, the load generator, Ray's calls and "
                   "token feeds, the KV send and receive threads; they share the workers' cores on one host. "
                   "0.42 with --frontend-ms-per-step 4.9: `--validate`'s request-path CPU under load fitted "
                   "over five mixes of the interference and chat presets on a 2-core x86 host (2.3-5.9 tokens "
                   "per engine step, 1.2-2.6 ms per token in all; each mix within 5%% of the fit); less when the "
                   "gateway and clients run elsewhere")
    p.add_argument("--frontend-ms-per-step", type=float, default=4.9,
                   help="CPU the request path spends per engine step that streams tokens, whatever their "
                   "number (ms): the step's feed item through the worker's actor threads, Ray's stream and "
                   "the gateway's dispatch, so a token costs more at low rates, where a step carries fewer. "
                   "4.9: fitted with --frontend-ms-per-token's default; `tandem bench request-path` measures "
                   "both at rest (less: 1.8 ms per step there), `--validate` under load (fitted over the mixes)")
    p.add_argument("--step-ms-per-token", type=float, default=0.3,
                   help="how much longer a served worker's step is than the profiled one per token it emits "
                   "(ms): the worker hands its outputs to the token feeds and its Ray threads hold the GIL "
                   "meanwhile. 0.3: decode steps of a 1P+1D server at batch 16 and 32 (`tandem bench serve "
                   "--rates inf --num-prompts N`: 37.3 and 57.0 ms between tokens) against the profile's "
                   "31.8 and 48.3 ms")
    p.add_argument("--prefill-step-factor", type=float, default=1.1,
                   help="a served worker's prompt computation against the profiled one (CPU per step): what "
                   "sharing the cores with the other workers and the request path costs a step (preemptions, "
                   "caches refilled); `--validate` measures it per mix. 1.1: 1.07-1.20 measured with one and two "
                   "prefill workers on a 2-core x86 host (chat and interference presets, 1-6 req/s)")
    p.add_argument("--decode-step-factor", type=float, default=1.3,
                   help="the same for the decode part of a step. 1.3: 1.20-1.35 measured there for one decode "
                   "worker beside one or two prefill workers; two and three colocated workers' steps took "
                   "1.22-1.30x their profiled cost in all")
    p.add_argument("--request-latency-ms", type=float, default=14.0,
                   help="a request's latency through the request path at rest, beyond its CPU (HTTP, routing, "
                   "Ray's calls there and back): every token reaches the client that much later. 14: an idle "
                   "1P+1D server's TTFT against the profile's prefill time on a 2-core x86 host (46.9 vs 32.4 ms "
                   "at 32 prompt tokens, 168 vs 152 ms at 256), less the ~1 ms of the first token's path CPU and "
                   "step cost that the simulation adds itself")
    p.add_argument("--cpu-sharing", choices=("placed", "fluid"), default="placed",
                   help="placed: each busy worker thread on one core, as Linux places them (three threads on "
                   "two cores: two share one), the request path's and the background's CPU on the cores no worker "
                   "holds first; fluid: every busy thread an equal share of all the cores (always so for "
                   "fractional --cores and GPU profiles)")
    p.add_argument("--request-path", default=None, metavar="FILE",
                   help="a `tandem bench request-path --json` of this host: its idle cores and CPU per step and "
                   "per token take the place of --server-idle-cores, --frontend-ms-per-step and "
                   "--frontend-ms-per-token")
    p.add_argument("--repeats", type=int, default=3, help="request sequences simulated per rate (seeds "
                   "SEED, SEED+1, ...; the first is the one `tandem bench serve` sends), pooled; `--validate` "
                   "sweeps each mix with every one of them and pools them the same way")
    p.add_argument("--helm-values", default=None, metavar="FILE", help="write the recommended mix's replicas "
                   "as a values file for the chart")
    p.add_argument("--validate", action="store_true", help="also measure each mix with real servers "
                   "(as `tandem bench compare` does) and print predicted vs measured goodput")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="--validate: extra `tandem serve` argument (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    serve_bench.add_workload_arguments(p)


def _requests(args: argparse.Namespace, rate_index: int, rate: float, seed: int) -> list[SimRequest]:
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
            sim = Simulation(_requests(args, k, rate, args.seed + rep), mix=mix, steps=steps, transfer=transfer,
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


def print_table(results: list[dict[str, Any]], target_rate: float, best: dict[str, Any] | None) -> None:
    print(f"{'mix':>17} {'cores':>5} {'goodput':>9} {'attain@' + f'{target_rate:g}':>10} "
          f"{'TTFT p50/p90 ms':>16} {'TPOT p50/p90 ms':>16}")
    for r in results:
        run = next(x for x in r["runs"] if x["rate"] == target_rate)["summary"]
        g = r["goodput"]
        fmt = serve_bench.fmt_num
        mark = "  <- recommended" if best is r else ""
        print(f"{r['label']:>17} {r['cores']:>5g} {goodput_text(g):>9} "
              f"{fmt(run['attainment']['both'], '.0%'):>10} "
              f"{fmt(run['ttft_ms']['p50']) + '/' + fmt(run['ttft_ms']['p90']):>16} "
              f"{fmt(run['tpot_ms']['p50'], '.1f') + '/' + fmt(run['tpot_ms']['p90'], '.1f'):>16}{mark}")


def main(args: argparse.Namespace) -> int:
    from services.bench import profile as profile_mod

    prof = profile_mod.load(args.profile)
    wl = serve_bench.plan(argparse.Namespace(**{**vars(args), "tokenizer": None}))
    rates = sorted(set(wl.rates) | ({args.target_rate} if args.target_rate else set()))
    if any(not math.isfinite(r) for r in rates):
        raise ValueError("tandem plan needs finite rates")
    target_rate = args.target_rate or max(rates)
    threads = args.threads_per_worker or prof["worker"]["threads_per_worker"]
    on_gpu = str(prof["hardware"].get("device", "cpu")).startswith("cuda")
    cores = args.cores or (math.inf if on_gpu else prof["hardware"]["cores"])  # GPU workers share no cores
    if args.repeats < 1 or threads < 1 or cores <= 0:
        raise ValueError("--repeats, --threads-per-worker and --cores must be positive")
    hw = Hardware(cores, threads, args.prefill_nice, args.background_cores, args.server_idle_cores,
                  args.frontend_ms_per_token / 1e3, args.step_ms_per_token / 1e3,
                  request_latency_s=args.request_latency_ms / 1e3, whole_cores=args.cpu_sharing == "placed",
                  frontend_s_per_step=args.frontend_ms_per_step / 1e3,
                  prefill_step_factor=args.prefill_step_factor, decode_step_factor=args.decode_step_factor)
    if args.request_path:
        path = json.loads(Path(args.request_path).read_text())
        hw = dataclasses.replace(hw, server_idle_cores=path["idle_cores"], frontend_s_per_step=path["per_step_s"],
                                 frontend_s_per_token=path["per_token_s"])
    max_workers = args.max_workers or (8 if on_gpu else max(2, int(2 * cores // threads)))
    mixes = [Mix.parse(m) for m in args.mixes.split(",")] if args.mixes else all_mixes(max_workers)
    if "transfer" not in prof["fit"] and any(not m.colocated for m in mixes):
        raise ValueError("the profile has no KV transfer part (--skip-transfer): plan colocated mixes only")
    results = [simulate(m, args, rates, wl.slo, prof, hw) for m in mixes]
    best = recommend(results, target_rate, wl.slo.attainment)
    slo = wl.slo.to_json()
    print(f"== plan: {wl.name}, {args.arrival} arrivals at {', '.join(f'{r:g}' for r in rates)} req/s, "
          f"{args.repeats} x {wl.config['requests_per_rate']} requests per rate; "
          f"SLO TTFT {serve_bench.fmt_num(slo['ttft_ms'])} ms, TPOT {serve_bench.fmt_num(slo['tpot_ms'])} ms "
          f"at {slo['attainment']:.0%}")
    burst = burst_models(prof) if bursts_on(args) and not on_gpu else None
    where = (f"one {prof['hardware'].get('gpu') or 'GPU'} per worker" if on_gpu
             else f"{prof['hardware']['cpu']}, {threads} thread(s) per worker on {cores:g} cores" +
             (f"; a pool of one worker bursts to {burst[0]} threads" if burst else "; no bursts"))
    print(f"profile: {where} (predicted; + = every rate met the SLO, sweep higher)")
    print_table(results, target_rate, best)
    out_dir = Path(args.out_dir) if args.out_dir else serve_bench.default_out_dir("plan")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"schema": SCHEMA, "meta": runinfo.describe(), "profile": str(args.profile),
               "workload": wl.config, "slo": slo, "target_rate": target_rate,
               "hardware": {**dataclasses.asdict(hw), "cores": cores if math.isfinite(cores) else None},
               "results": results,
               "recommended": best["label"] if best else None}
    if best is None:
        print(f"no mix considered ({', '.join(m.label for m in mixes)}) meets the SLO at {target_rate:g} req/s"
              + ("; no helm values written" if args.helm_values else ""))
    else:
        print(f"recommended: {best['label']} ({best['cores']:g} cores), predicted goodput "
              f"{best['goodput']['interpolated_rps']:.2f} req/s")
        if args.helm_values:
            Path(args.helm_values).write_text(helm_values(Mix(**best["mix"]), (
                f"tandem plan: {wl.name} at {target_rate:g} req/s, SLO TTFT {slo['ttft_ms']} ms / TPOT "
                f"{slo['tpot_ms']} ms at {slo['attainment']:.0%}: {best['label']}"),
                prof["worker"].get("weight_layouts"), args.local_prefill_threshold,
                threads=None if on_gpu else threads, prefill_saturation_s=args.prefill_saturation_s))
            print(f"helm values: {args.helm_values}")
    if not args.no_plots:
        from services.bench import plots

        for r in results:
            r["config"] = {"workload_name": f"tandem plan (predicted): {wl.name}"}
        summary["plot"] = str(plots.compare(results, out_dir / "plan.png"))
    if args.validate:
        from services.bench.plan_validate import validate

        summary["validation"] = validate(args, prof, mixes, results, rates, target_rate, hw, out_dir)
    (out_dir / "plan.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(f"results: {out_dir / 'plan.json'}")
    return 0 if best is not None else 1
