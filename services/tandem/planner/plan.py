"""``tandem plan``: size the pools for a workload and an SLO from a ``tandem profile``.

For every mix within the worker budget (``xP+yD`` disaggregated, ``xP+yD-conditional``:
disaggregated with short prompts prefilled on the decode worker, ``colocated×n``), the
simulator (``tandem.planner.plan_sim``) serves the workload's request sequence (the same
one ``tandem bench serve`` sends: preset or dataset lengths, arrivals, seeds) at each
rate; the records are scored as a measured run is (``tandem.bench.metrics_math``:
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

from tandem.bench import runinfo
from tandem.bench import serve as serve_bench
from tandem.bench.metrics_math import goodput_text
from tandem.common.config import LOCAL_PREFILL_THRESHOLD, PREFILL_SATURATION_S
from tandem.engine.progress import progress
from tandem.planner.cpu_share import Hardware
from tandem.planner.mix import Mix, all_mixes, helm_values
from tandem.planner.prediction import burst_models, bursts_on, recommend, simulate

SCHEMA = "tandem.plan/v1"


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
    from tandem.planner import profile as profile_mod

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
    quiet = getattr(args, "quiet", False)
    results = [simulate(m, args, rates, wl.slo, prof, hw)
               for m in progress(mixes, desc="tandem plan: mixes", unit="mix", disable=quiet)]  # a terminal's
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
        from tandem.bench import plots

        for r in results:
            r["config"] = {"workload_name": f"tandem plan (predicted): {wl.name}"}
        summary["plot"] = str(plots.compare(results, out_dir / "plan.png"))
    if args.validate:
        from tandem.planner.plan_validate import validate

        summary["validation"] = validate(args, prof, mixes, results, rates, target_rate, hw, out_dir)
    (out_dir / "plan.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(f"results: {out_dir / 'plan.json'}")
    return 0 if best is not None else 1
