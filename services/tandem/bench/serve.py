"""``tandem bench serve``: TTFT, TPOT, ITL and goodput of any OpenAI-compatible server under load.

Sends one seeded request sequence (synthetic lengths, a preset, or a local dataset) at
each rate of a sweep (Poisson, constant or burst arrivals), streams every response, and
writes ``results.json`` (every request's record, per-rate summaries, SLO attainment,
DistServe goodput, what was measured where) plus PNG plots into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench import runinfo
from tandem.bench.arrivals import KINDS, arrival_offsets, parse_rates
from tandem.bench.metrics_math import SLO, goodput, summarize
from tandem.bench.workload import BenchRequest, LengthDist, RequestClass, describe, get_preset
from tandem.engine.progress import bar

SCHEMA = "tandem.bench.serve/v1"
WARMUP_SALT = 2**31 - 1  # the warm-up's prompts: no sweep has this many rates
WARMUP_MAX_TOKENS = 16
DEFAULTS = {"num_prompts": 50, "rates": "1,2,4", "input_len": "128", "output_len": "128"}


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Workload, arrival, SLO and output flags (shared with ``tandem bench compare``)."""
    w = p.add_argument_group("workload")
    w.add_argument("--preset", default=None, help="named workload: chat | interference (sets the lengths, "
                   "prompt count, rates and SLO below unless given)")
    w.add_argument("--dataset", default=None, help="local JSON/JSONL prompts (ShareGPT-style works)")
    w.add_argument("--input-len", default=None, help="prompt tokens: N or uniform:LOW-HIGH (default 128)")
    w.add_argument("--output-len", default=None, help="output tokens: N or uniform:LOW-HIGH (default 128)")
    w.add_argument("--num-prompts", type=int, default=None, help="requests per rate (default 50)")
    w.add_argument("--tokenizer", default=None, help="the served checkpoint's folder (exact token counts; "
                   "default: none, synthetic prompts use ids 16..999)")
    w.add_argument("--seed", type=int, default=0, help="one seed for the request sequence and the arrivals")
    w.add_argument("--prompt-salt", type=int, default=None,
                   help="synthetic prompts' token ids come from the seed, the rate and this salt (default: "
                   "a fresh one per run, in results.json: a server that keeps a prefix cache across runs, as "
                   "vLLM's does, must not find a repeated run's prompts in it; give it to replay a run)")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--token-timing", default="logprobs", choices=["logprobs", "text"],
                   help="logprobs: ask for logprobs=0 so every token's chunk is seen and timed; text: time "
                   "only chunks with text (servers without logprobs)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", default="poisson", choices=KINDS)
    a.add_argument("--rates", default=None, help="comma-separated req/s to sweep, inf allowed (default 1,2,4)")
    a.add_argument("--burst-size", type=int, default=None, help="burst arrivals: requests per burst (default all)")
    a.add_argument("--warmup", type=int, default=4, help="requests sent together before the sweep, not recorded: "
                   "the longest prompt of each request class first, prompts the sweep never sends")
    a.add_argument("--cooldown", type=float, default=2.0, help="seconds of idle between rates")
    a.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    a.add_argument("--max-duration", type=float, default=300.0, help="seconds per rate; the rest is cancelled")
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-attainment", type=float, default=0.9, help="share that must meet both (DistServe)")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default=None, help="where results.json and the PNGs go "
                   "(default bench-results/<kind>-<date>)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress line")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of an OpenAI-compatible server (no /v1)")
    p.add_argument("--model-name", default=None, help="model id to request (default: the first /v1/models lists)")
    p.add_argument("--label", default=None, help="name of this system in tables and plots (default: the mode)")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                   help="extra description of the server (mode, pools, hardware ...; repeatable)")
    add_workload_arguments(p)


@dataclass(frozen=True)
class Plan:
    """The resolved workload of a run: explicit flags over the preset over the defaults.

    ``requests(k)``: the requests of the k-th rate (same lengths at every rate, fresh
    prompts, the same for every server).
    """

    name: str
    requests: Callable[[int], list[BenchRequest]]
    rates: list[float]
    slo: SLO
    config: dict[str, Any]

    def warmup(self, count: int) -> list[BenchRequest]:
        """``count`` requests that no rate sends, the longest prompt of each request class
        first: a server's first long prompt (and what it compiles or allocates for one)
        comes before the measurement, not in its first rate."""
        pool = self.requests(WARMUP_SALT)
        longest: dict[str, BenchRequest] = {}
        for r in pool:
            if r.kind not in longest or (r.prompt_len or 0) > (longest[r.kind].prompt_len or 0):
                longest[r.kind] = r
        first = sorted(longest.values(), key=lambda r: -(r.prompt_len or 0))
        return (first + [r for r in pool if r not in first])[:max(count, 0)]


def _pick(args: argparse.Namespace, preset: Any, key: str) -> Any:
    value = getattr(args, key)
    if value is not None:
        return value
    return getattr(preset, key) if preset is not None else DEFAULTS.get(key)


def plan(args: argparse.Namespace) -> Plan:
    """Build the request sequence, rates and SLO from the flags."""
    from tandem.bench import dataset
    from tandem.bench.workload import ordinary_token_ids, synthetic

    preset = get_preset(args.preset) if args.preset else None
    tokenizer = None
    if args.tokenizer:
        from tandem.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(args.tokenizer)
    n = _pick(args, preset, "num_prompts")
    if n < 1:
        raise ValueError("--num-prompts must be >= 1")
    out_len = LengthDist.parse(args.output_len or DEFAULTS["output_len"])
    if args.prompt_salt is not None and args.prompt_salt < 0:
        raise ValueError("--prompt-salt must be >= 0")
    run_salt = args.prompt_salt if args.prompt_salt is not None else secrets.randbits(31)
    if args.dataset:
        def requests(k: int) -> list[BenchRequest]:
            return dataset.load(args.dataset, n, args.seed, out_len, tokenizer, salt=k)

        name, classes = f"dataset:{Path(args.dataset).name}", None
    else:
        if preset is not None and args.input_len is None and args.output_len is None:
            classes = list(preset.classes)
        else:
            classes = [RequestClass("synthetic", 1.0, LengthDist.parse(args.input_len or DEFAULTS["input_len"]),
                                    out_len)]
        ids = ordinary_token_ids(tokenizer)

        def requests(k: int) -> list[BenchRequest]:
            return synthetic(classes, n, args.seed, ids, salt=k, run=run_salt)

        name = preset.name if preset is not None else "synthetic"
    ttft, tpot = _pick(args, preset, "slo_ttft_ms"), _pick(args, preset, "slo_tpot_ms")
    slo = SLO(None if ttft is None else ttft / 1e3, None if tpot is None else tpot / 1e3, args.slo_attainment)
    rates = parse_rates(_pick(args, preset, "rates"))
    config = {"workload_name": name, "preset": args.preset, "dataset": args.dataset,
              "classes": [c.to_json() for c in classes] if classes else None,
              "requests_per_rate": n, "request_mix": describe(requests(0)), "seed": args.seed,
              "prompt_salt": None if args.dataset else run_salt,
              "tokenizer": args.tokenizer, "ignore_eos": args.ignore_eos, "token_timing": args.token_timing,
              "arrival": args.arrival,
              "burst_size": args.burst_size, "rates": [r if math.isfinite(r) else None for r in rates],
              "warmup": args.warmup,
              "request_timeout_s": args.request_timeout, "max_duration_s": args.max_duration}
    return Plan(name, requests, rates, slo, config)


async def _warmup(url: str, model: str, requests: list[BenchRequest], timeout_s: float) -> None:
    """Send ``requests`` together (at most ``WARMUP_MAX_TOKENS`` out each) and wait for all."""
    import httpx

    from tandem.bench.client import completion_body, stream_completion

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(
            stream_completion(client, url, completion_body(model, r.prompt, min(r.output_len, WARMUP_MAX_TOKENS)),
                              timeout_s) for r in requests))
    for res in results:
        if res.error:
            raise RuntimeError(f"warm-up request to {url} failed: {res.error}: {res.detail}")


def sweep(url: str, model: str, p: Plan, args: argparse.Namespace, label: str,
          server_meta: dict[str, Any]) -> dict[str, Any]:
    """Run every rate of ``p`` against ``url``; the results dict (schema ``SCHEMA``), plots not yet drawn."""
    from tandem.bench.loadgen import run_requests

    meta = {**runinfo.describe(), "server": {"url": url, "model": model, **server_meta}}
    runs = []
    with bar(len(p.rates), desc=f"{label}: rates", unit="rate", disable=args.quiet) as swept:  # a terminal's
        swept.set_postfix("warm-up")
        asyncio.run(_warmup(url, model, p.warmup(args.warmup), args.request_timeout))
        for k, rate in enumerate(p.rates):
            if k:
                time.sleep(args.cooldown)
            swept.set_postfix(f"{rate:g} req/s")
            requests = p.requests(k)
            offsets = arrival_offsets(args.arrival, rate, len(requests), args.seed, args.burst_size)
            res = asyncio.run(run_requests(url, model, requests, offsets, request_timeout_s=args.request_timeout,
                                           max_duration_s=args.max_duration, ignore_eos=args.ignore_eos,
                                           logprobs=0 if args.token_timing == "logprobs" else None,
                                           label=f"{label} {rate:g} req/s", progress=not args.quiet))
            runs.append({"rate": rate if math.isfinite(rate) else None, "arrival": args.arrival,
                         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         "client_cpu_s": res.client_cpu_s,
                         "summary": summarize(res.records, res.duration_s, p.slo), "requests": res.records})
            swept.update()
    good = goodput([(r["rate"], r["summary"]["attainment"]["both"]) for r in runs], p.slo.attainment)
    return {"schema": SCHEMA, "label": label, "meta": meta, "config": p.config, "slo": p.slo.to_json(),
            "runs": runs, "goodput": good, "plots": {}}


def write(result: dict[str, Any], out_dir: Path, plots: bool = True, stem: str = "") -> Path:
    """``<out_dir>/<stem>results.json`` and, with ``plots``, its three PNGs (paths in ``result['plots']``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        from tandem.bench import plots as draw

        result["plots"] = {
            "latency_cdf": str(draw.latency_cdfs([result], out_dir / f"{stem}latency_cdf.png")),
            "attainment": str(draw.attainment_vs_rate([result], out_dir / f"{stem}attainment.png")),
            "goodput": str(draw.goodput([result], out_dir / f"{stem}goodput.png"))}
    path = out_dir / f"{stem}results.json"
    path.write_text(json.dumps(result, indent=1, allow_nan=False))
    return path


def rate_label(rate: float | None) -> str:
    """A run's rate for tables (``None``: everything at once, "inf")."""
    return "inf" if rate is None else f"{rate:g}"


def fmt_num(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def print_summary(result: dict[str, Any]) -> None:
    slo = result["slo"]
    print(f"== {result['label']}: {result['config']['workload_name']}, {result['config']['arrival']} arrivals, "
          f"{result['config']['requests_per_rate']} requests per rate; SLO TTFT {fmt_num(slo['ttft_ms'])} ms, "
          f"TPOT {fmt_num(slo['tpot_ms'])} ms at {slo['attainment']:.0%}")
    print(f"{'rate':>6} {'ok':>7} {'errors':>14} {'TTFT p50/p90/p99 ms':>20} {'TPOT p50/p90/p99':>17} "
          f"{'ITL p90/p99':>12} {'e2e p90':>8} {'out tok/s':>9} {'attain':>6}")
    for run in result["runs"]:
        s = run["summary"]
        t, o, i = s["ttft_ms"], s["tpot_ms"], s["itl_ms"]
        errs = ",".join(f"{k}:{v}" for k, v in s["errors"].items()) or "0"
        print(f"{rate_label(run['rate']):>6} {s['completed']:>3}/{s['requests']:<3} {errs:>14} "
              f"{fmt_num(t['p50'])+'/'+fmt_num(t['p90'])+'/'+fmt_num(t['p99']):>20} "
              f"{fmt_num(o['p50'],'.1f')+'/'+fmt_num(o['p90'],'.1f')+'/'+fmt_num(o['p99'],'.1f'):>17} "
              f"{fmt_num(i['p90'])+'/'+fmt_num(i['p99']):>12} {fmt_num(s['e2e_ms']['p90']):>8} "
              f"{fmt_num(s['throughput']['output_tokens_per_s']):>9} {fmt_num(s['attainment']['both'], '.0%'):>6}")
    cut = [(rate_label(r["rate"]), r["summary"].get("not_sent", 0)) for r in result["runs"]]
    if any(n for _, n in cut):
        print("WARNING: requests NOT SENT because a rate's run reached --max-duration "
              f"({result['config']['max_duration_s']:g} s); they are not errors and are left out of "
              "every figure above: " + ", ".join(f"{n} at {rate} req/s" for rate, n in cut if n))
    print(runinfo.machine_line())
    g = result["goodput"]
    if g["below_sweep"]:
        print(f"goodput: below {g['points'][0][0]:g} req/s (the lowest rate swept missed the SLO: "
              "sweep lower rates, or loosen --slo-*)")
    else:
        print(f"goodput: {g['interpolated_rps']:.2f} req/s interpolated ({g['rps']:g} swept)"
              + ("" if g["bounded"] else "  (every rate met the SLO: a lower bound, sweep higher)"))


def default_out_dir(kind: str) -> Path:
    return Path("bench-results") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _meta_args(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--meta takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main(args: argparse.Namespace) -> int:
    from tandem.bench.client import first_model, server_pools

    url = args.url.rstrip("/")
    model = args.model_name or first_model(url)
    p = plan(args)
    server_meta: dict[str, Any] = {}
    pools = server_pools(url)
    if pools:
        server_meta.update(pools=pools, mode="colocated" if "both" in pools else "disaggregated")
    server_meta.update(_meta_args(args.meta))
    label = args.label or server_meta.get("mode") or "server"
    result = sweep(url, model, p, args, label, server_meta)
    path = write(result, Path(args.out_dir) if args.out_dir else default_out_dir("serve"), not args.no_plots)
    print_summary(result)
    print(f"results: {path}")
    return 0 if any(r["summary"]["completed"] for r in result["runs"]) else 1
