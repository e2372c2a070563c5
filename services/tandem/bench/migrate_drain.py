"""``tandem bench migrate``, part 2: a decode worker drained under load, its requests
moved with their KV against re-driven.

``streams`` requests start at once on a 1P+2D cluster; once every client has
``drain_after`` tokens, the decode worker holding most of them is drained
(``Cluster.drain_worker``, ``drain_timeout`` seconds for its requests to finish in place,
default none):

- ``migrate``: as configured, its requests move to the other decode worker first;
- ``redrive``: the same drain with ``kv_migration`` off on the ``Cluster`` object
  (``cluster.config`` replaced for the drain's duration, the transfer group as it was),
  so the requests still there are re-driven when its actor exits: prompt plus tokens so
  far prefilled again on the other decode worker.

Per arm: goodput (tokens of all streams over the wall time from the first request sent
to the last token), the p99 and largest gap between consecutive deltas over every
stream, the drain's length, the requests it moved and the re-drives the driver made
meanwhile. Arms alternate, migrate first; between them
the pool is scaled back to two decode workers and the new worker warmed up. The same
prompts run in both arms of a round: greedy with EOS ignored, their tokens must match.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import statistics
import time
import uuid

from tandem.bench.metrics_math import percentile
from tandem.bench.migrate_pause import ARMS, MIGRATE, REDRIVE, Stream, prompt_ids
from tandem.common.sampling_params import SamplingParams


async def warm_up(cluster, vocab: int, tokens: int = 96) -> None:
    """Two short streams, each moved to the other decode worker and back (every decode
    worker's feed open on this event loop, both directions of a move run once)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    async def one(i: int) -> None:
        rid = f"warm-{i}-{uuid.uuid4().hex[:8]}"
        fut, moves, seen = None, 0, 0
        async for delta in cluster.generate(prompt_ids(24, vocab, f"warm-{i}"), params,
                                            request_id=rid):
            seen += len(delta.token_ids)
            if moves < 2 and (fut is None or fut.done()) and seen >= 4 * (moves + 1) \
                    and not delta.finished:
                try:
                    fut, moves = cluster.migrate(rid), moves + 1
                except Exception:  # noqa: BLE001 - a warm-up: whatever it manages
                    moves = 2
    await asyncio.gather(one(0), one(1))


async def run_arm(cluster, arm: str, prompts: list[list[int]], output_len: int,
                  drain_after: int, drain_timeout: float) -> tuple[dict, list[list[int]]]:
    """One drain under load; returns its figures and each stream's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    streams = [Stream() for _ in prompts]
    rids = [f"{arm}{i}-{uuid.uuid4().hex[:8]}" for i in range(len(prompts))]
    ready = asyncio.Event()
    errors: list[str] = []

    async def one(i: int) -> None:
        s = streams[i]
        try:
            async for delta in cluster.generate(prompts[i], params, request_id=rids[i]):
                s.arrivals.append(time.perf_counter())
                s.tokens += delta.token_ids
                if all(len(x.tokens) >= drain_after for x in streams):
                    ready.set()
        except Exception as e:  # noqa: BLE001 - counted, the run goes on
            errors.append(f"{type(e).__name__}: {e}")
            ready.set()

    redrives = cluster.driver.num_redrives
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    await ready.wait()
    held = collections.Counter(w.worker_id for w in map(cluster.router.decode_of, rids) if w)
    victim = max(cluster.decode, key=lambda w: held.get(w.worker_id, 0)).worker_id
    report = await asyncio.to_thread(_drain, cluster, victim, drain_timeout,
                                     migration=arm == MIGRATE)
    await asyncio.gather(*tasks)
    wall = max((s.arrivals[-1] for s in streams if s.arrivals), default=t0) - t0
    gaps = [g for s in streams for g in s.gaps()]
    tokens = sum(len(s.tokens) for s in streams)
    return dict(arm=arm, goodput_tok_s=tokens / wall if wall > 0 else 0.0, seconds=wall,
                tokens=tokens, itl_p99_ms=1e3 * (percentile(gaps, 99) or 0.0),
                itl_max_ms=1e3 * max(gaps, default=0.0), drained=victim,
                streams_on_it=held.get(victim, 0), drain_s=report.seconds,
                migrated=report.migrated, redriven=cluster.driver.num_redrives - redrives,
                drain_report_redriven=report.redriven, errors=errors), \
        [s.tokens for s in streams]


def _drain(cluster, worker_id: str, timeout_s: float, migration: bool):
    """``drain_worker``, with moves off on the cluster object for its duration unless
    ``migration``."""
    config = cluster.config
    if not migration:
        cluster.config = dataclasses.replace(config, kv_migration=False)
    try:
        return cluster.drain_worker(worker_id, timeout_s)
    finally:
        cluster.config = config


async def measure(cluster, repeats: int, streams: int, prompt_len: int, output_len: int,
                  drain_after: int, drain_timeout: float, vocab: int,
                  progress=lambda msg: None) -> dict:
    """``repeats`` rounds of migrate then re-drive; each arm's runs, medians and the
    median of the rounds' goodput ratios (migrate over re-drive)."""
    decode_workers = len(cluster.decode)
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    mismatches = []
    first = True
    for r in range(repeats):
        prompts = [prompt_ids(prompt_len, vocab, f"load-{r}-{i}") for i in range(streams)]
        outputs = {}
        for arm in ARMS:
            if not first:  # the drained worker replaced; the new one warmed up
                await asyncio.to_thread(cluster.scale, "decode", decode_workers)
                await warm_up(cluster, vocab)
            first = False
            run, outputs[arm] = await run_arm(cluster, arm, prompts, output_len, drain_after,
                                              drain_timeout)
            runs[arm].append(run)
            progress(f"drain round {r + 1}/{repeats} {arm}: {run['goodput_tok_s']:.1f} tok/s, "
                     f"max gap {run['itl_max_ms']:.0f} ms, {run['migrated']} moved, "
                     f"{run['redriven']} re-driven")
        mismatches += [dict(round=r, stream=i) for i, (a, b) in
                       enumerate(zip(outputs[MIGRATE], outputs[REDRIVE])) if a != b]
    summary = {a: {k: statistics.median(run[k] for run in runs[a])
                   for k in ("goodput_tok_s", "itl_p99_ms", "itl_max_ms", "drain_s")}
               for a in ARMS}
    ratios = [m["goodput_tok_s"] / d["goodput_tok_s"] for m, d in zip(runs[MIGRATE], runs[REDRIVE])]
    return dict(runs=runs, median=summary, goodput_ratio=statistics.median(ratios),
                mismatches=mismatches)
