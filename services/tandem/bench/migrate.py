"""``tandem bench migrate``: requests leaving a decode worker, moved with their KV against
re-driven (prefilled again), on one 1P+2D cluster in one run.

1. Pause per context length (``migrate_pause``): the longest gap a client sees when its
   request moves to the other decode worker, ``Cluster.migrate`` against the driver's
   re-drive path, interleaved over ``--repeats`` rounds, medians.
2. A drain under load (``migrate_drain``): ``--streams`` concurrent requests, one decode
   worker drained mid-run with migration and with re-drive (interleaved rounds):
   goodput, p99 and largest inter-token gap.

Greedy, EOS ignored: every stream's tokens must equal the other arm's; mismatches are
reported and make the exit status 1. Prefix caching is off (a re-drive finds no KV to
reuse); the KV cache and threads are the cluster's defaults unless set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from tandem.bench import migrate_drain, migrate_pause, runinfo
from tandem.router.migration import HEADROOM_TOKENS

SCHEMA = "tandem.bench.migrate/v1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="a model folder or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--contexts", default="auto",
                   help="comma-separated context lengths at the move (tokens held); auto: 256, "
                        "512, ... and the longest the model and one decode worker's KV cache take")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per context")
    p.add_argument("--move-after", type=int, default=8, help="tokens streamed before the move")
    p.add_argument("--output-len", type=int, default=64, help="tokens per stream of part 1")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of the drain")
    p.add_argument("--load-prompt-len", type=int, default=512)
    p.add_argument("--load-output-len", type=int, default=128)
    p.add_argument("--drain-after", type=int, default=16,
                   help="the drain starts once every stream has this many tokens")
    p.add_argument("--drain-timeout", type=float, default=0.0,
                   help="seconds a drained worker's requests may finish in place first")
    p.add_argument("--drain-repeats", type=int, default=None,
                   help="interleaved drain rounds (default: --repeats)")
    p.add_argument("--skip-pause", action="store_true")
    p.add_argument("--skip-drain", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: sized to this host)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache per worker, GiB")
    p.add_argument("--json", default=None, help="also write the results to this file")


def _cluster(args: argparse.Namespace, model: str):
    from tandem.cluster.cluster import Cluster
    from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig

    engine = EngineConfig(model=model, cache=CacheConfig(memory_gb=args.kv_cache_gb,
                                                         enable_prefix_caching=False))
    config = ClusterConfig(engine=engine, prefill_workers=1, decode_workers=2,
                           threads_per_worker=args.threads, kv_migration=True)
    return Cluster(config, progress=_progress).start()


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check(args: argparse.Namespace) -> None:
    if args.repeats < 1 or (args.drain_repeats is not None and args.drain_repeats < 1):
        raise ValueError("--repeats and --drain-repeats must be at least 1")
    if not 0 < args.move_after < args.output_len:
        raise ValueError("--move-after must be positive and below --output-len")
    if not 0 < args.drain_after < args.load_output_len:
        raise ValueError("--drain-after must be positive and below --load-output-len")
    if args.streams < 2:
        raise ValueError("--streams must be at least 2")


async def _cache_tokens(cluster) -> int:
    """Tokens the smallest decode worker's KV cache holds."""
    stats = await cluster.worker_stats()
    ids = {w.worker_id for w in cluster.decode}
    blocks = min(s["total_blocks"] for s in stats if s.get("worker_id") in ids)
    return blocks * cluster.config.engine.cache.block_size


def main(args: argparse.Namespace) -> int:
    from tandem.bench.spec import model_path
    from tandem.engine.model.config import ModelConfig

    _check(args)
    model = model_path(args.model)
    mc = ModelConfig.from_dir(model)
    max_len = mc.max_position_embeddings
    print(runinfo.machine_line())
    cluster = _cluster(args, model)
    cc = cluster.config
    result: dict = dict(schema=SCHEMA, model=model, run=runinfo.describe(),
                        config=dict(vars(args), func=None, threads_per_worker=cc.threads_per_worker,
                                    decode_burst_threads=cc.decode_burst_threads,
                                    prefill_burst_threads=cc.prefill_burst_threads))
    try:
        capacity = asyncio.run(_cache_tokens(cluster))
        longest = migrate_pause.longest_context(max_len, capacity, args.output_len,
                                                args.move_after, cluster.config.engine.cache.block_size)
        result.update(max_model_len=max_len, cache_tokens=capacity, longest_context=longest)
        print(f"model {model}: {max_len} positions; {capacity} tokens of KV per decode worker; "
              f"{cluster.config.threads_per_worker} thread(s) per worker")
        need = args.streams * (args.load_prompt_len + args.load_output_len + HEADROOM_TOKENS)
        if not args.skip_drain and (need > capacity
                                    or args.load_prompt_len + args.load_output_len > max_len):
            raise ValueError(f"{args.streams} streams of {args.load_prompt_len}+"
                             f"{args.load_output_len} tokens do not fit one decode worker "
                             f"({capacity} tokens) or the model ({max_len})")
        if not args.skip_pause:
            lens = migrate_pause.contexts(args.contexts, longest, args.move_after)
            result["pause"] = asyncio.run(migrate_pause.measure(
                cluster, lens, args.repeats, args.output_len, args.move_after, mc.vocab_size,
                _progress))
            print_pause(result["pause"], args)
        if not args.skip_drain:
            async def drain() -> dict:
                await migrate_drain.warm_up(cluster, mc.vocab_size)
                return await migrate_drain.measure(
                    cluster, args.drain_repeats or args.repeats, args.streams,
                    args.load_prompt_len, args.load_output_len, args.drain_after,
                    args.drain_timeout, mc.vocab_size, _progress)
            result["drain"] = asyncio.run(drain())
            print_drain(result["drain"], args)
    finally:
        cluster.shutdown()
    result["load_avg_at_end"] = runinfo.machine()["load_avg_at_start"]
    mismatches = sum(len(r["mismatches"]) for r in result.get("pause", [])) + \
        len(result.get("drain", {}).get("mismatches", []))
    result["mismatches"] = mismatches
    if mismatches:
        print(f"\n{mismatches} streams differ between the arms (see --json)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if mismatches else 0


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_pause(rows: list[dict], args: argparse.Namespace) -> None:
    """Part 1's table."""
    print(f"\npause of a stream moving to the other decode worker: longest gap between "
          f"deltas, median of {args.repeats} interleaved rounds (ms)")
    print(f"{'context':>7} {'step':>7} {'migrate':>9} {'re-drive':>9} {'ratio':>6} "
          f"{'KV MB':>7} {'moved':>6} {'redriven':>8} {'same':>5}")
    for r in rows:
        m, d, n = r["migrate"], r["redrive"], r["repeats"]
        print(f"{r['context']:7d} {_f(r['step_ms']):>7} {_f(m['median_pause_ms']):>9} "
              f"{_f(d['median_pause_ms']):>9} {_f(r['ratio'], '.2f'):>6} {_f(m['kv_mb']):>7} "
              f"{m['moved']:>3}/{n:<2} {d['redriven']:>5}/{n:<2} "
              f"{'NO' if r['mismatches'] else 'yes':>5}")
    print("(step: median gap before the move; ratio: median of the rounds' re-drive/migrate)")


def print_drain(d: dict, args: argparse.Namespace) -> None:
    """Part 2's table."""
    rounds = len(d["runs"]["migrate"])
    print(f"\n{args.streams} streams of {args.load_prompt_len}+{args.load_output_len} tokens on "
          f"1P+2D, a decode worker drained once each has {args.drain_after} (drain timeout "
          f"{args.drain_timeout:g}s); medians of {rounds} interleaved rounds")
    print(f"{'arm':>8} {'goodput tok/s':>13} {'p99 gap ms':>10} {'max gap ms':>10} "
          f"{'drain s':>7} {'moved':>6} {'redriven':>8}")
    for arm, label in (("migrate", "migrate"), ("redrive", "re-drive")):
        med, runs = d["median"][arm], d["runs"][arm]
        print(f"{label:>8} {med['goodput_tok_s']:13.1f} {med['itl_p99_ms']:10.1f} "
              f"{med['itl_max_ms']:10.1f} {med['drain_s']:7.2f} "
              f"{sum(r['migrated'] for r in runs):>6} {sum(r['redriven'] for r in runs):>8}")
    errors = sum(len(r["errors"]) for arm in d["runs"].values() for r in arm)
    same = f"differ in {len(d['mismatches'])} streams" if d["mismatches"] else "identical"
    print(f"goodput migrate/re-drive: {d['goodput_ratio']:.2f} (median of the rounds' ratios); "
          f"outputs {same}" + (f"; {errors} streams failed" if errors else ""))
