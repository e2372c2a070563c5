"""``tandem plan --validate``: the plan's predictions against real servers on this machine.

Each mix is started as ``tandem bench compare`` starts a system (``tandem serve`` in a
subprocess, stopped before the next) and swept with the same request sequences, rates
and SLO the plan simulated (one sweep per ``--repeats`` seed, pooled per rate as the
simulation pools them); prints predicted vs measured goodput with the error, and
whether the plan's recommendation is the measured best (the same rule applied to the
measured attainment).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench import runinfo
from tandem.bench import serve as serve_bench
from tandem.bench.metrics_math import SLO, goodput, goodput_text, summarize
from tandem.planner.mix import conditional_args
from tandem.planner.perf_model import StepModel
from tandem.planner.prediction import models, recommend, simulate
from tandem.engine.progress import progress
from tandem.bench.server_cpu import (TELEMETRY_WAIT_S, engine_counters, fit_per_step_and_token, idle_cores,
                                       path_cpu_s)
from tandem.router.load import DECODE, PREFILL


@dataclass
class Measured:
    """One mix's sweep and the CPU around it."""

    result: dict[str, Any]  # as `tandem bench serve` writes it
    background_cores: float  # other processes' CPU meanwhile
    idle_cores: float  # the server's own CPU at rest (load polls, Ray): paid at any rate
    frontend_s_per_token: float | None  # the gateway's and the client's CPU per streamed token
    # the whole request path's, less the idle CPU over the sweep and the configured cost per step
    path_s_per_token: float | None
    steps: float | None = None  # engine steps the workers ran
    path_cpu_s: float | None = None  # the whole request path's CPU, less the idle CPU over the sweep
    tokens: int = 0  # streamed
    engine_by_role: dict[str, tuple[float, float]] = field(default_factory=dict)  # role -> (step CPU s, steps)


def step_factors(measured: dict[str, tuple[float, float]], simulated: dict[str, dict[str, float]],
                 steps: StepModel, default: tuple[float, float]) -> dict[str, float]:
    """The served step factors (``prefill``, ``decode``) a sweep measured: per worker role
    its engine steps' CPU (``measured``: role -> CPU s, steps) against the profiled cost of
    the same requests' steps in the simulation (``simulate``'s ``engine``, run with both
    factors 1), the difference in step count at a step's fixed cost. Prefill workers give
    the prompt factor, decode workers the decode factor (a conditional one's local prompts
    included); colocated workers, whose steps do
    both, scale ``default`` (prompt, decode) to their CPU. Factors no role measured are left out."""
    out = {}
    for role, (cpu, n) in measured.items():
        sim = simulated.get(role)
        if not sim or not n:
            continue
        extra = n - sim["steps"]  # steps the simulation ran fewer, at a step's fixed cost
        if role in (PREFILL, DECODE):
            fixed = steps.prefill.base if role == PREFILL else steps.decode.base
            expected = sim["prefill_s"] + sim["decode_s"] + extra * fixed
            if expected > 0:
                out[role] = cpu / expected
            continue
        expected = default[0] * sim["prefill_s"] + default[1] * (sim["decode_s"] + extra * steps.decode.base)
        if expected > 0:
            out.update({PREFILL: default[0] * cpu / expected, DECODE: default[1] * cpu / expected})
    return out


def server_layout_args(prof: dict[str, Any]) -> list[str]:
    """`tandem serve` flags that give the served workers the weight layouts their steps were
    profiled on (none for profiles taken before layouts were recorded)."""
    layouts = prof["worker"].get("weight_layouts")
    if not layouts:
        return []
    return [f"--cpu-weight-layout={layouts['colocated']}", f"--prefill-weight-layout={layouts['prefill']}",
            f"--decode-weight-layout={layouts['decode']}"]


def burst_args(result: dict[str, Any]) -> list[str]:
    """`tandem serve` flags for the burst threads a mix was simulated with (``simulate``'s
    result); a --server-arg after them may still override them."""
    b = result["bursts"]
    return [f"--decode-burst-threads={b['decode']}", f"--prefill-burst-threads={b['prefill']}"]


def error(predicted: float, measured: float) -> float | None:
    """Relative error of a prediction (None when nothing was measured)."""
    return predicted / measured - 1.0 if measured else None


def validate(args: argparse.Namespace, prof: dict[str, Any], mixes: list[Any], predicted: list[dict[str, Any]],
             rates: list[float], target_rate: float, hw: Any, out_dir: Path) -> dict[str, Any]:
    """Measure every mix, and predict it again under the background load measured meanwhile;
    the validation block of ``plan.json``."""
    from tandem.bench.launcher import TandemServer

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the server's `with`: it is stopped too

    signal.signal(signal.SIGTERM, on_sigterm)
    model = prof["model"]["path"]
    sweeps = []  # (workload, its args) per simulated sequence: seeds SEED, SEED+1, ...
    for k in range(args.repeats):
        bench_args = argparse.Namespace(**{**vars(args), "tokenizer": args.tokenizer or model, "seed": args.seed + k,
                                           "warmup": args.warmup if k == 0 else 0})  # warm once per server
        sweeps.append((dataclasses.replace(serve_bench.plan(bench_args), rates=rates), bench_args))
    wl = sweeps[0][0]
    threads = args.threads_per_worker or prof["worker"]["threads_per_worker"]
    extra = server_layout_args(prof) + list(args.server_arg) + \
        ([f"--prefill-nice={args.prefill_nice}"] if args.prefill_nice else [])
    measured, loaded, rows = [], [], []
    for mix, pred in progress(list(zip(mixes, predicted)), desc="tandem plan --validate: mixes", unit="mix",
                              disable=getattr(args, "quiet", False)):
        load_before = runinfo.machine()["load_avg_at_start"]
        local = conditional_args(mix, args.local_prefill_threshold, args.prefill_saturation_s,
                                 defaults_too=True)
        server = TandemServer(model, mode=mix.mode,
                              prefill_workers=0 if mix.colocated else mix.prefill, decode_workers=mix.decode,
                              threads_per_worker=threads, extra_args=burst_args(pred) + extra + local,
                              log_path=out_dir / f"measured-{mix.label}-server.log",
                              startup_timeout_s=args.startup_timeout)
        print(f"measuring {mix.label}: {' '.join(server.argv[3:])}", flush=True)
        try:
            got = _measure(server, sweeps, mix.label, model, hw.frontend_s_per_step)
        except RuntimeError as e:  # e.g. it could not start (the log's tail is in the message)
            print(f"{mix.label} NOT measured: {e}", flush=True)
            rows.append({"mix": mix.label, "failed": str(e).splitlines()[0]})
            continue
        result, idle = got.result, got.idle_cores
        frontend = got.frontend_s_per_token if got.frontend_s_per_token is not None else hw.frontend_s_per_token
        # the whole request path (gateway, client, Ray, the workers outside their engine
        # steps) as the frontend's per-token CPU, the server's CPU at rest as background:
        # all of it competes for the same cores
        path = got.path_s_per_token if got.path_s_per_token is not None else frontend
        load = dataclasses.replace(hw, background_cores=got.background_cores, server_idle_cores=idle,
                                   frontend_s_per_token=path)
        as_profiled_steps = simulate(mix, args, rates, wl.slo, prof,
                                     dataclasses.replace(load, prefill_step_factor=1.0, decode_step_factor=1.0))
        factors = step_factors(got.engine_by_role, as_profiled_steps["engine"],
                               models(prof, not args.keep_profile_load, mix.colocated)[0],
                               (hw.prefill_step_factor, hw.decode_step_factor))
        load = dataclasses.replace(load, prefill_step_factor=factors.get(PREFILL, hw.prefill_step_factor),
                                   decode_step_factor=factors.get(DECODE, hw.decode_step_factor))
        under_load = simulate(mix, args, rates, wl.slo, prof, load)
        loaded.append(under_load)
        as_profiled = simulate(mix, argparse.Namespace(**{**vars(args), "keep_profile_load": True}), rates,
                               wl.slo, prof, dataclasses.replace(hw, background_cores=0.0))
        serve_bench.write(result, out_dir, not args.no_plots, stem=f"measured-{mix.label}-")
        serve_bench.print_summary(result)
        result["cores"] = pred["cores"]
        measured.append(result)
        p, m = under_load["goodput"]["interpolated_rps"], result["goodput"]["interpolated_rps"]
        q = as_profiled["goodput"]["interpolated_rps"]
        rows.append({"mix": mix.label, "quiet_predicted_rps": pred["goodput"]["interpolated_rps"],
                     "as_profiled_rps": q, "as_profiled_error": error(q, m),
                     "background_cores": got.background_cores, "idle_cores": idle,
                     "frontend_ms_per_token": 1e3 * frontend,
                     "request_path_ms_per_token": 1e3 * path, "engine_steps": got.steps,
                     "step_factors": factors, "engine_cpu_s_and_steps": got.engine_by_role,
                     "request_path_cpu_s": got.path_cpu_s, "tokens": got.tokens, "predicted_rps": p,
                     "predicted_bounded": under_load["goodput"]["bounded"],
                     "predicted_text": goodput_text(under_load["goodput"]),
                     "measured_rps": m, "measured_bounded": result["goodput"]["bounded"],
                     "measured_text": goodput_text(result["goodput"]), "error": error(p, m),
                     # per rate, as the measured results (measured-MIX-results.json) have them
                     "predicted_runs": under_load["runs"],
                     "load_avg_before": load_before, "load_avg_after": runinfo.machine()["load_avg_at_start"]})
    best_pred = recommend(loaded, target_rate, wl.slo.attainment)
    best_meas = recommend(measured, target_rate, wl.slo.attainment)
    out = {"rows": rows, "request_path_fit": path_fit(rows),
           "recommended_under_load": best_pred["label"] if best_pred else None,
           "measured_best": best_meas["label"] if best_meas else None,
           "measured_ranking": [r["label"] for r in sorted(measured, key=lambda r: -r["goodput"]["interpolated_rps"])]}
    print_validation(out)
    return out


def _measure(server: Any, sweeps: list[tuple[Any, argparse.Namespace]], label: str, model: str,
             path_s_per_step: float) -> Measured:
    """Sweep one started-here server once per workload of ``sweeps`` (pooled per rate: ``pool``).
    Its request path's CPU is the server's process tree
    (gateway, Ray, workers) plus the client, less the engine steps' CPU the workers
    count and the tree's CPU at rest (measured before the sweep) over the sweep's length
    (``server_cpu``); per token, once ``path_s_per_step`` per engine step is taken out."""
    from tandem.bench.cpu_load import BackgroundSampler, process_cpu_seconds, tree_cpu_seconds

    with server:
        gateway_pid = server.proc.pid
        idle = idle_cores(gateway_pid)
        sampler = BackgroundSampler(lambda: [os.getpid(), gateway_pid])
        cpu0, tree0, engine0 = process_cpu_seconds(gateway_pid) or 0.0, tree_cpu_seconds(gateway_pid), \
            engine_counters(server.url)
        t0 = time.monotonic()
        with sampler:
            results = []
            for k, (wl, bench_args) in enumerate(sweeps):
                if k:
                    time.sleep(bench_args.cooldown)
                results.append(serve_bench.sweep(server.url, server.served_model_name, wl, bench_args, label,
                                                 {**server.describe(), "model_path": model}))
        result = pool(results, sweeps[0][0].slo)
        swept_s = time.monotonic() - t0
        gateway_cpu = (process_cpu_seconds(gateway_pid) or cpu0) - cpu0
        tree_cpu = tree_cpu_seconds(gateway_pid) - tree0
        time.sleep(TELEMETRY_WAIT_S)  # /metrics serves the workers' counters as last refreshed
        engine1 = engine_counters(server.url)
    bg = sampler.stop() or 0.0
    tokens = sum(run["summary"]["output_tokens"] for run in result["runs"])
    client_cpu = sum(run["client_cpu_s"] for run in result["runs"])
    if not tokens:
        return Measured(result, bg, idle, None, None)
    if engine0 is None or engine1 is None:
        return Measured(result, bg, idle, (gateway_cpu + client_cpu) / tokens, None)
    steps = engine1.steps - engine0.steps
    path = path_cpu_s(tree_cpu, client_cpu, engine0, engine1, idle, swept_s)
    return Measured(result, bg, idle, (gateway_cpu + client_cpu) / tokens,
                    max(0.0, path - path_s_per_step * steps) / tokens, steps, path, tokens, engine1.since(engine0))


def path_fit(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The request path's CPU under load as ``per_step * steps + per_token * tokens``, fitted
    over the measured mixes (their steps per token differ: None when fewer than two do)."""
    pts = [(r["engine_steps"], r["tokens"], r["request_path_cpu_s"]) for r in rows
           if r.get("engine_steps") and r.get("tokens") and r.get("request_path_cpu_s") is not None]
    try:
        per_step, per_token = fit_per_step_and_token(pts)
    except ValueError:
        return None
    return {"per_step_s": per_step, "per_token_s": per_token, "mixes": len(pts)}


def pool(results: list[dict[str, Any]], slo: SLO) -> dict[str, Any]:
    """Sweeps of one server at the same rates as one result: each rate's requests pooled,
    scored as one run (as the simulation pools its repeats)."""
    if len({tuple(run["rate"] for run in r["runs"]) for r in results}) != 1:
        raise ValueError("pooled sweeps must share their rates")
    runs = []
    for per_rate in zip(*(r["runs"] for r in results)):
        records = [rec for run in per_rate for rec in run["requests"]]
        duration = sum(run["summary"]["duration_s"] for run in per_rate)
        runs.append({**per_rate[0], "client_cpu_s": sum(run["client_cpu_s"] for run in per_rate),
                     "summary": summarize(records, duration, slo), "requests": records,
                     "sweeps": len(per_rate)})
    good = goodput([(r["rate"], r["summary"]["attainment"]["both"]) for r in runs], slo.attainment)
    config = {**results[0]["config"], "requests_per_rate": sum(r["config"]["requests_per_rate"] for r in results),
              "seed": None, "seeds": [r["config"]["seed"] for r in results]}
    return {**results[0], "config": config, "runs": runs, "goodput": good}


def _factors(f: dict[str, float]) -> str:
    return "/".join(serve_bench.fmt_num(f.get(part), ".2f") for part in (PREFILL, DECODE))


def print_validation(v: dict[str, Any]) -> None:
    print()
    print(runinfo.machine_line())
    print("goodput (req/s; + = every rate met the SLO, < = the lowest missed it) predicted: on a quiet machine; with the step times as "
          "profiled (the load then); under the background measured during the run (cores other processes "
          "used, bg, plus the server's own CPU at rest, idle) with the request path's CPU measured then (path "
          "ms: per token, everything outside the engine steps and the idle CPU beyond the plan's "
          "--frontend-ms-per-step per engine step; fe ms: the gateway's and the client's, all of it, per "
          "token) and the served engine steps' CPU against the profiled steps' (steps P/D: the "
          "prompt and the decode factor, colocated workers' CPU splitting them as the defaults do); and "
          "measured, with the errors of the last two predictions")
    print(f"{'mix':>13} {'quiet':>7} {'profiled':>8} {'error':>6} {'bg cores':>8} {'idle':>5} {'fe ms':>5} "
          f"{'path ms':>7} {'steps P/D':>9} {'predicted':>10} {'measured':>10} "
          f"{'error':>7}   load avg (1 min) before/after")
    pct = lambda e: serve_bench.fmt_num(None if e is None else 100 * e, "+.0f") + "%"  # noqa: E731
    for r in v["rows"]:
        if "failed" in r:
            print(f"{r['mix']:>13} not measured: {r['failed']}")
            continue
        err = pct(r["error"])[:-1]
        print(f"{r['mix']:>13} {r['quiet_predicted_rps']:>7.2f} {r['as_profiled_rps']:>8.2f} "
              f"{pct(r['as_profiled_error']):>6} {r['background_cores']:>8.2f} "
              f"{r.get('idle_cores', 0.0):>5.2f} {r['frontend_ms_per_token']:>5.2f} "
              f"{r.get('request_path_ms_per_token', r['frontend_ms_per_token']):>7.2f} "
              f"{_factors(r.get('step_factors', {})):>9} "
              f"{r['predicted_text']:>10} {r['measured_text']:>10} {err + '%':>7}   "
              f"{r['load_avg_before'][0]:.2f}/{r['load_avg_after'][0]:.2f}")
    fit = v.get("request_path_fit")
    if fit:
        print(f"request path under load, fitted over {fit['mixes']} mixes: {1e3 * fit['per_step_s']:.2f} ms per "
              f"engine step + {1e3 * fit['per_token_s']:.2f} ms per token (`tandem plan --frontend-ms-per-step`, "
              f"`--frontend-ms-per-token`)")
    print(f"recommended (predicted under that load): {v['recommended_under_load']}; best by the same rule, "
          f"measured: {v['measured_best']}; "
          f"measured goodput ranking: {', '.join(v['measured_ranking'])}")
