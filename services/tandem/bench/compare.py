"""``tandem bench compare``: tandem disaggregated vs colocated (same workers, same cores) and,
optionally, another OpenAI-compatible server, on one request sequence and one rate sweep.

Each tandem system is started in turn as its own ``tandem serve`` subprocess on a free
port (stopped before the next starts, also on errors); ``--other-url`` is measured as it
is, last, but checked first (it must list a model at ``/v1/models``). Every system gets the
same seeded requests at the same arrival times. Writes each system's results
(``<label>-results.json`` and PNGs), ``compare.json`` and ``compare.png`` into
``--out-dir``, and prints a ratio table against the baseline.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

from tandem.bench import runinfo
from tandem.bench import serve as serve_bench
from tandem.bench.metrics_math import goodput_text
from tandem.engine.progress import bar

SYSTEMS = ("disaggregated", "colocated", "conditional")
SCHEMA = "tandem.bench.compare/v1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder (default: the embedded `bench` checkpoint)")
    p.add_argument("--systems", default="disaggregated,colocated",
                   help=f"tandem modes to start, in order (of {', '.join(SYSTEMS)})")
    p.add_argument("--prefill-workers", type=int, default=1, help="disaggregated/conditional prefill pool")
    p.add_argument("--decode-workers", type=int, default=1, help="disaggregated/conditional decode pool; "
                   "colocated gets prefill+decode workers")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `tandem serve` argument for every tandem system (repeatable, e.g. "
                   "--server-arg=--max-num-seqs=64)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--other-url", default=None, help="another server on the same checkpoint (e.g. vLLM)")
    p.add_argument("--other-label", default="other")
    p.add_argument("--other-model-name", default=None, help="its model id (default: the first it lists)")
    p.add_argument("--baseline", default="colocated", help="the system the ratios divide by")
    serve_bench.add_workload_arguments(p)


def _servers(args: argparse.Namespace, model: str) -> list[tuple[str, Any]]:
    from tandem.bench.launcher import TandemServer

    out = []
    for mode in [s.strip() for s in args.systems.split(",") if s.strip()]:
        if mode not in SYSTEMS:
            raise ValueError(f"unknown system {mode!r}; known: {', '.join(SYSTEMS)}")
        pf, dc = ((0, args.prefill_workers + args.decode_workers) if mode == "colocated"
                  else (args.prefill_workers, args.decode_workers))
        out.append((mode, lambda mode=mode, pf=pf, dc=dc, log=None: TandemServer(
            model, mode=mode, prefill_workers=pf, decode_workers=dc,
            threads_per_worker=args.threads_per_worker, extra_args=args.server_arg, log_path=log,
            startup_timeout_s=args.startup_timeout)))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(results: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """Goodput and p90 TTFT/TPOT per rate for each system, and each system's ratio to ``baseline``."""
    base = next((r for r in results if r["label"] == baseline), results[0])
    rows: list[dict[str, Any]] = []

    def row(name: str, values: dict[str, float | None], higher_is_better: bool) -> None:
        rows.append({"metric": name, "higher_is_better": higher_is_better, "values": values,
                     "ratio_to_baseline": {k: _ratio(v, values[base["label"]]) for k, v in values.items()}})

    row("goodput (req/s)", {r["label"]: r["goodput"]["interpolated_rps"] for r in results}, True)
    rows[-1]["texts"] = {r["label"]: goodput_text(r["goodput"]) for r in results}
    for k, run in enumerate(base["runs"]):
        for key, name in (("ttft_ms", "p90 TTFT (ms)"), ("tpot_ms", "p90 TPOT (ms)")):
            row(f"{name} @ {serve_bench.rate_label(run['rate'])}/s",
                {r["label"]: r["runs"][k]["summary"][key]["p90"] if k < len(r["runs"]) else None
                 for r in results}, False)
    for k, run in enumerate(base["runs"]):
        row(f"SLO attainment @ {serve_bench.rate_label(run['rate'])}/s",
            {r["label"]: r["runs"][k]["summary"]["attainment"]["both"] if k < len(r["runs"]) else None
             for r in results}, True)
    return {"baseline": base["label"], "rows": rows}


def print_table(table: dict[str, Any], labels: list[str]) -> None:
    others = [lb for lb in labels if lb != table["baseline"]]
    head = f"{'':28}" + "".join(f"{lb:>15}" for lb in labels) + "".join(
        f"{lb[:8] + '/' + table['baseline'][:6]:>17}" for lb in others)
    print(runinfo.machine_line())
    print(head)
    for row in table["rows"]:
        fmt = ".0%" if row["metric"].startswith("SLO") else (".2f" if "goodput" in row["metric"] else ".1f")
        cells = "".join(f"{row['texts'][lb] if 'texts' in row else serve_bench.fmt_num(row['values'][lb], fmt):>15}"
                        for lb in labels)
        rat = "".join(f"{serve_bench.fmt_num(row['ratio_to_baseline'][lb], '.2f') + 'x':>17}" for lb in others)
        print(f"{row['metric']:28}{cells}{rat}")


def main(args: argparse.Namespace) -> int:
    from tandem.bench import plots
    from tandem.bench.client import first_model
    from tandem.engine.default_model import default_model_path

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the servers' `with`: they are stopped too

    signal.signal(signal.SIGTERM, on_sigterm)
    model = args.model or str(default_model_path("bench"))
    if args.tokenizer is None:
        args.tokenizer = model  # exact token counts from the served checkpoint
    out_dir = Path(args.out_dir) if args.out_dir else serve_bench.default_out_dir("compare")
    out_dir.mkdir(parents=True, exist_ok=True)
    p = serve_bench.plan(args)
    other = None
    if args.other_url:  # before the tandem sweeps: an unusable URL fails now, not minutes later
        url = args.other_url.rstrip("/")
        listed = first_model(url)
        other = url, args.other_model_name or listed
    results: list[dict[str, Any]] = []
    servers = _servers(args, model)
    with bar(len(servers) + (other is not None), desc="compare: systems", unit="system",
             disable=args.quiet) as measured:  # on a terminal only
        for label, make in servers:
            measured.set_postfix(label)
            server = make(log=out_dir / f"{label}-server.log")
            print(f"starting tandem {label}: {' '.join(server.argv[3:])}", flush=True)
            with server:
                meta = {**server.describe(), "model_path": model}
                result = serve_bench.sweep(server.url, server.served_model_name, p, args, label, meta)
            serve_bench.write(result, out_dir, not args.no_plots, stem=f"{label}-")
            serve_bench.print_summary(result)
            results.append(result)
            measured.update()
        if other is not None:
            measured.set_postfix(args.other_label)
            result = serve_bench.sweep(*other, p, args, args.other_label, {"model_path": model})
            serve_bench.write(result, out_dir, not args.no_plots, stem=f"{args.other_label}-")
            serve_bench.print_summary(result)
            results.append(result)
            measured.update()
    table = ratios(results, args.baseline)
    labels = [r["label"] for r in results]
    print()
    print_table(table, labels)
    summary = {"schema": SCHEMA, "meta": results[0]["meta"], "config": p.config, "slo": p.slo.to_json(),
               "systems": {r["label"]: {"server": r["meta"]["server"], "goodput": r["goodput"],
                                        "results": f"{r['label']}-results.json",
                                        "runs": [{k: v for k, v in run.items() if k != "requests"}
                                                 for run in r["runs"]]} for r in results},
               "ratios": table}
    if not args.no_plots:
        summary["plot"] = str(plots.compare(results, out_dir / "compare.png"))
    path = out_dir / "compare.json"
    path.write_text(json.dumps(summary, indent=1, allow_nan=False))
    print(f"results: {path}")
    return 0
