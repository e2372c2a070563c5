"""``tandem bench spec-placement``: where a draft model's prompt KV should be computed.

In disaggregated mode the draft model runs on the decode worker, and its KV for the
prompt must come from somewhere. Either the decode worker prefills the draft itself
(what tandem does: no extra bytes, the work lands on the decode worker), or the
prefill worker runs the draft over the prompt as well and ships the draft's KV
with the target's (no draft work on D, more bytes, the draft's prefill on the
request's critical path before token #1 leaves P). Measured here, side by side:

1. per prompt length: the draft's prefill time (one forward over the prompt, and in
   ``draft_prefill_chunk`` chunks as the decode worker does it) against the time to
   move the draft's KV bytes between two Ray actors over gloo with the KV protocol
   (``bench/transfer.py``'s bandwidth test on a cache shaped like the draft's), and the
   target's KV bytes for scale;
2. the inter-token latency of streams already decoding on a decode-role engine (with
   draft speculation) while a long prompt's KV is imported and its draft catches up:
   the median and worst step before and after, with the catch-up bounded per step
   (``--chunk``) and unbounded, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target: a folder or 'default'")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="draft: the target's first N layers (default: --draft-model)")
    p.add_argument("--draft-model", default=None, metavar="PATH")
    p.add_argument("--prompt-lens", default="128,512,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=None,
                   help="catch-up tokens per step (default: SpeculativeConfig's)")
    p.add_argument("--streams", type=int, default=4, help="streams decoding when the prompt arrives")
    p.add_argument("--arrival-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-transfer", action="store_true")
    p.add_argument("--json", default=None)


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 4000 + 100 for i in range(n)]  # no prefix hits across salts


def draft_prefill_ms(draft: str, lens: list[int], chunk: int, repeats: int) -> list[dict]:
    """Median ms of the draft's prefill of ``n`` tokens: one forward, and in chunks."""
    from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.common.sampling_params import SamplingParams
    from tandem.engine.engine import LLMEngine

    params = SamplingParams(temperature=0.0, max_tokens=1)
    engines = {budget: LLMEngine(EngineConfig(
        model=draft, cache=CacheConfig(memory_gb=0.25, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget))) for budget in (4096, chunk)}
    rows = []
    for n in lens:
        times: dict[int, list[float]] = {b: [] for b in engines}
        for r in range(repeats + 1):
            for budget, eng in engines.items():
                eng.add_request(f"p{n}-{r}", _prompt(n, r), params)
                t0 = time.perf_counter()
                while eng.has_unfinished():
                    eng.step()
                if r:  # the first round warms up
                    times[budget].append(time.perf_counter() - t0)
        rows.append(dict(prompt_len=n, draft_prefill_ms=1e3 * statistics.median(times[4096]),
                         draft_prefill_chunked_ms=1e3 * statistics.median(times[chunk])))
    return rows


def kv_bytes(model: str, n: int) -> int:
    from tandem.engine.model.config import ModelConfig

    mc = ModelConfig.from_dir(model)
    return mc.num_layers * 2 * n * mc.num_kv_heads * mc.head_dim * 4  # fp32


def transfer_ms(draft: str, lens: list[int], repeats: int) -> list[float]:
    """Median ms to move the draft's KV of ``n`` tokens with the KV protocol over gloo."""
    import ray

    from tandem.bench.transfer import bandwidth

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    sizes = [kv_bytes(draft, n) / 2**20 for n in lens]
    rows = bandwidth(draft, sizes, repeats)
    return [1e3 * r["mb"] * 2**20 / (r["kv_per_layer_gb_s"] * 1e9) for r in rows]


def arrival_itl(target: str, draft: str, chunk: int, streams: int, arrival_len: int,
                repeats: int) -> list[dict]:
    """Step times of a decode engine's running streams around a long prompt's arrival."""
    from tandem.common.config import (CacheConfig, EngineConfig, EngineRole, SchedulerConfig,
                                        SpeculativeConfig)
    from tandem.common.sampling_params import SamplingParams
    from tandem.engine.engine import LLMEngine

    cache = CacheConfig(memory_gb=0.5, enable_prefix_caching=False)
    prefill = LLMEngine(EngineConfig(model=target, cache=cache, scheduler=SchedulerConfig(
        role=EngineRole.PREFILL, max_num_batched_tokens=4096)))
    budgets = {"bounded": chunk, "unbounded": 1 << 20}
    decode = {name: LLMEngine(EngineConfig(
        model=target, cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=4096),
        speculative=SpeculativeConfig(method="draft", draft_model=draft, draft_prefill_chunk=b)))
        for name, b in budgets.items()}
    mc = prefill.model_config
    arrival = _prompt(arrival_len, 99)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    prefill.add_request("long", arrival, first)
    token = None
    while prefill.has_unfinished():
        for o in prefill.step():
            token = o.new_token_ids[0] if o.new_token_ids else token
    kv = prefill.export_kv(prefill.prefilled_blocks("long"), range(mc.num_layers)).clone()
    prefill.release("long")
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    samples: dict[str, dict[str, list[float]]] = {n: {"before": [], "after": []} for n in budgets}
    for r in range(repeats):
        for name in (budgets if r % 2 == 0 else list(budgets)[::-1]):
            eng = decode[name]
            for i in range(streams):
                eng.add_request(f"s{r}-{i}", _prompt(48, 10 * r + i), params)
            for _ in range(12):  # prefilled, drafting
                eng.step()
            for _ in range(8):
                t0 = time.perf_counter()
                eng.step()
                samples[name]["before"].append(time.perf_counter() - t0)
            rid = f"long{r}"
            blocks = eng.reserve(rid, arrival, params)
            eng.import_kv(blocks, range(mc.num_layers), kv)
            eng.commit_imported(rid, token)
            steps = 2 + -(-arrival_len // budgets[name])
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                samples[name]["after"].append(time.perf_counter() - t0)
            for rid_ in [rid] + [f"s{r}-{i}" for i in range(streams)]:
                eng.abort(rid_)
    return [dict(catch_up=name, chunk=budgets[name] if name == "bounded" else None,
                 median_before_ms=1e3 * statistics.median(s["before"]),
                 median_after_ms=1e3 * statistics.median(s["after"]),
                 worst_after_ms=1e3 * max(s["after"]))
            for name, s in samples.items()]


def main(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench import runinfo
    from tandem.bench.spec import model_path
    from tandem.common.config import SpeculativeConfig
    from tandem.engine.spec.truncated_draft import truncated_draft_path

    torch.set_num_threads(args.threads)
    target = model_path(args.model)
    if (args.draft_layers is None) == (args.draft_model is None):
        raise ValueError("give one of --draft-layers N or --draft-model PATH")
    draft = args.draft_model or str(truncated_draft_path(target, args.draft_layers))
    chunk = args.chunk or SpeculativeConfig().draft_prefill_chunk
    lens = [int(x) for x in args.prompt_lens.split(",")]
    print(runinfo.machine_line())
    print(f"target {target}\ndraft {draft}, catch-up chunk {chunk}, {args.threads} threads")
    result: dict = dict(target=target, draft=draft, chunk=chunk, run=runinfo.describe())
    rows = draft_prefill_ms(draft, lens, chunk, args.repeats)
    moves = [None] * len(lens) if args.skip_transfer else transfer_ms(draft, lens, args.repeats)
    print(f"\n{'prompt':>6} {'draft KV MB':>11} {'target KV MB':>12} {'draft prefill ms':>16} "
          f"{'chunked ms':>10} {'ship draft KV ms':>16}")
    for row, move in zip(rows, moves):
        n = row["prompt_len"]
        row.update(draft_kv_mb=kv_bytes(draft, n) / 2**20, target_kv_mb=kv_bytes(target, n) / 2**20,
                   transfer_ms=move)
        print(f"{n:6d} {row['draft_kv_mb']:11.2f} {row['target_kv_mb']:12.2f} "
              f"{row['draft_prefill_ms']:16.1f} {row['draft_prefill_chunked_ms']:10.1f} "
              f"{'-' if move is None else f'{move:.1f}':>16}")
    result["prefill_vs_transfer"] = rows
    itl = arrival_itl(target, draft, chunk, args.streams, args.arrival_len, args.repeats)
    result["arrival"] = itl
    print(f"\n{args.streams} streams decoding with draft speculation when a {args.arrival_len}-token "
          f"prompt's KV is imported (step = their inter-token latency):")
    print(f"{'catch-up':>10} {'median before ms':>16} {'median after ms':>15} {'worst after ms':>14}")
    for r in itl:
        label = f"{r['catch_up']}" + (f" {r['chunk']}" if r["chunk"] else "")
        print(f"{label:>10} {r['median_before_ms']:16.1f} {r['median_after_ms']:15.1f} "
              f"{r['worst_after_ms']:14.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
