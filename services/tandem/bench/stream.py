"""``tandem bench stream``: per-token overhead of gateway + Ray, and concurrent streams held.

Starts ``tandem serve`` (a subprocess, embedded tiny model unless --model) or
uses --url. Overhead: one stream's client-side inter-token gaps minus the
engine's own decode-step time for the same single sequence, measured in this
process on the same checkpoint and thread count. Concurrency: N streams opened
at once, each to the end; counts those that finish without an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from tandem.bench import runinfo
from tandem.bench.client import completion_body, first_model, stream_completion
from tandem.bench.metrics_math import percentile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--model", default=None, help="local HF folder (default: the tiny preset)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--streams", type=int, default=500, help="concurrent streams to hold")
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens per concurrent stream")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)


async def _stream(client, url: str, model: str, prompt: list[int],
                  max_tokens: int) -> tuple[list[float], int]:
    """Arrival times of the text events, and the completion tokens the usage reports."""
    res = await stream_completion(client, url, completion_body(model, prompt, max_tokens))
    if res.error is not None:
        raise RuntimeError(f"{res.error}: {res.detail}")
    return res.token_times, res.completion_tokens or 0


def _engine_step_ms(model: str, threads: int, tokens: int) -> list[float]:
    import torch

    from tandem.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    engine = LLM(model, num_threads=threads).engine
    engine.add_request("x", [5] * 16, SamplingParams(temperature=0, max_tokens=tokens,
                                                      ignore_eos=True))
    engine.step()
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


async def _measure(url: str, model: str, args) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        await _stream(client, url, model, [5] * 16, 4)  # warm up
        stamps, _ = await _stream(client, url, model, [5] * 16, args.tokens)
        gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(_stream(client, url, model, [5 + i % 50] * 16, args.stream_tokens)
              for i in range(args.streams)), return_exceptions=True)
        elapsed = time.perf_counter() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    complete = [r for r in results if not isinstance(r, BaseException) and r[1] == args.stream_tokens]
    return dict(itl_ms=gaps, streams=args.streams, streams_ok=len(complete), stream_errors=len(errors),
                first_error=repr(errors[0])[:300] if errors else None, concurrent_seconds=elapsed,
                concurrent_tok_s=sum(r[1] for r in complete) / elapsed)


def main(args: argparse.Namespace) -> int:
    from tandem.engine.default_model import default_model_path

    model = args.model or str(default_model_path("tiny"))
    server = None
    url = args.url
    if url is None:
        from tandem.bench.launcher import TandemServer

        server = TandemServer(model, threads_per_worker=args.threads, served_model_name="bench",
                              extra_args=["--max-num-seqs", "1024",
                                          "--max-queued-requests", str(4 * args.streams)]).start()
        url = server.url
    try:
        served = "bench" if server is not None else first_model(url)
        result = asyncio.run(_measure(url, served, args))
    finally:
        if server is not None:
            server.stop()
    steps = _engine_step_ms(model, args.threads, args.tokens)
    itl = result.pop("itl_ms")
    step50 = percentile(steps, 50)
    over = {q: percentile([g - step50 for g in itl], q) for q in (50, 99)}  # gap minus a typical step
    result.update(itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99),
                  engine_step_p50_ms=percentile(steps, 50), engine_step_p99_ms=percentile(steps, 99),
                  overhead_p50_ms=over[50], overhead_p99_ms=over[99])
    print(runinfo.machine_line())
    print(f"one stream of {args.tokens} tokens ({model}):")
    print(f"  client inter-token gap  p50 {result['itl_p50_ms']:.2f} ms  p99 {result['itl_p99_ms']:.2f} ms")
    print(f"  engine decode step      p50 {result['engine_step_p50_ms']:.2f} ms  "
          f"p99 {result['engine_step_p99_ms']:.2f} ms")
    print(f"  gateway + Ray overhead  p50 {over[50]:.2f} ms  p99 {over[99]:.2f} ms per token")
    print(f"{args.streams} concurrent streams x {args.stream_tokens} tokens: {result['streams_ok']} "
          f"completed, {result['stream_errors']} errors, {result['concurrent_seconds']:.1f}s, "
          f"{result['concurrent_tok_s']:.0f} tok/s")
    if result["first_error"]:
        print(f"  first error: {result['first_error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["stream_errors"] == 0 else 1
