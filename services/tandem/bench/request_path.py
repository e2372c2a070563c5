"""``tandem bench request-path``: what serving costs outside the engine steps, for ``tandem plan``.

Starts a 1P+1D server (one thread per worker, as ``tandem profile`` sets workers up) and
measures, on a machine otherwise at rest:

- its CPU at rest (load polls, Ray): ``--server-idle-cores`` of the plan;
- batches of N concurrent streams (``--streams``, each ``--input-len`` prompt tokens and
  ``--output-len`` tokens, all sent at once; ``--rounds`` rounds, the sizes interleaved):
  the request path's CPU over each batch, i.e. the server's process tree and this client's
  CPU less the engine steps' CPU (``tandem_engine_step_cpu_seconds``, helpers included) and the idle
  CPU over that time, against the engine steps run (``tandem_engine_steps``) and the tokens
  streamed. A least-squares fit ``path = per_step * steps + per_token * tokens`` separates
  what each step's feed item costs (the worker's actor threads, Ray's stream, the
  gateway's dispatch) from what each token costs (detokenization, JSON, SSE, the client):
  the plan's ``--frontend-ms-per-step`` and ``--frontend-ms-per-token``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.bench import runinfo
from tandem.bench.server_cpu import (TELEMETRY_WAIT_S, engine_counters, fit_per_step_and_token, idle_cores,
                                       path_cpu_s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: the bench preset)")
    p.add_argument("--streams", default="1,4,16,32", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the batch sizes")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `tandem serve` argument (repeatable)")
    p.add_argument("--json", default=None, help="also write the figures here")


@dataclass(frozen=True)
class Batch:
    """One batch of concurrent streams and what the request path spent on it."""

    streams: int
    tokens: int
    steps: float
    path_cpu_s: float
    seconds: float


def main(args: argparse.Namespace) -> int:
    from tandem.bench.cpu_load import tree_cpu_seconds, wait_until_idle
    from tandem.bench.launcher import TandemServer
    from tandem.bench.loadgen import run_requests
    from tandem.bench.workload import FALLBACK_TOKEN_IDS, BenchRequest
    from tandem.engine.default_model import default_model_path

    sizes = [int(x) for x in args.streams.split(",")]
    if args.rounds < 1 or any(n < 1 for n in sizes) or args.output_len < 2 or args.input_len < 1:
        raise ValueError("--rounds, --streams and --input-len must be positive, --output-len at least 2")
    model = args.model or str(default_model_path("bench"))
    ids = list(FALLBACK_TOKEN_IDS)
    batches: list[Batch] = []
    with TandemServer(model, extra_args=args.server_arg) as server:
        pid = server.proc.pid
        idle = idle_cores(pid)
        k = 0
        for _ in range(args.rounds):
            for n in sizes:
                requests = []
                for i in range(n):  # a fresh prompt each: no prefix-cache hit
                    prompt = [ids[(k * 7919 + j * 31) % len(ids)] for j in range(args.input_len)]
                    requests.append(BenchRequest(i, prompt, args.input_len, args.output_len, "stream"))
                    k += 1
                wait_until_idle(pid)
                before, tree0, t0 = engine_counters(server.url), tree_cpu_seconds(pid), time.monotonic()
                res = asyncio.run(run_requests(server.url, server.served_model_name, requests, [0.0] * n,
                                               label=f"{n} streams", progress=False))
                time.sleep(TELEMETRY_WAIT_S)  # /metrics serves the workers' counters as last refreshed
                after, tree1, seconds = engine_counters(server.url), tree_cpu_seconds(pid), time.monotonic() - t0
                if before is None or after is None:
                    raise RuntimeError("the server's /metrics could not be read")
                if not all(r["ok"] for r in res.records):
                    raise RuntimeError(f"{n} streams: a request failed: {res.records}")
                tokens = sum(r["output_tokens"] for r in res.records)
                path = path_cpu_s(tree1 - tree0, res.client_cpu_s, before, after, idle, seconds)
                batches.append(Batch(n, tokens, after.steps - before.steps, path, seconds))
                print(f"{n:>4} streams: {tokens:>5} tokens, {after.steps - before.steps:>5.0f} steps, "
                      f"request path {path:6.2f} CPU-s", flush=True)
    per_step, per_token = fit_per_step_and_token([(b.steps, b.tokens, b.path_cpu_s) for b in batches])
    resid = [b.path_cpu_s - per_step * b.steps - per_token * b.tokens for b in batches]
    print(runinfo.machine_line())
    print(f"server at rest: {idle:.3f} cores")
    print(f"request path: {1e3 * per_step:.2f} ms per engine step + {1e3 * per_token:.3f} ms per token "
          f"(fit residuals {min(resid):+.2f}..{max(resid):+.2f} CPU-s)")
    print(f"tandem plan ... --server-idle-cores {idle:.2f} --frontend-ms-per-step {1e3 * per_step:.2f} "
          f"--frontend-ms-per-token {1e3 * per_token:.2f}")
    if args.json:
        out: dict[str, Any] = {"meta": runinfo.describe(), "idle_cores": idle, "per_step_s": per_step,
                               "per_token_s": per_token, "batches": [asdict(b) for b in batches]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
