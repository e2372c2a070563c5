"""``tandem bench spec``: output tokens/s with and without speculative decoding.

Engines on the same checkpoint in one process, one without speculation and one
per speculative variant (prompt lookup ``ngram``; ``draft`` from ``--draft-model``;
``draftN`` from the target's first N layers, ``--draft-layers``), run the same
batches interleaved (off, a, b, ..., then reversed) at each batch size, on the
workloads:

- ``edit``: "rewrite this text" chat requests quoting a passage, so a model
  that copies its input is drafted well by prompt lookup;
- ``chat``: short free-form chat prompts, where drafts come only from the
  model's own repetitions;
- ``oracle``: the edit prompts with drafts read from the plain run's output,
  every one accepted (first variant only): the ceiling speculation reaches at each batch size, i.e.
  what verifying ``k + 1`` positions costs against the decode steps it saves
  (where to switch speculation off: ``SpeculativeConfig.max_batch_size``).

Then the step costs behind the policy: the median time of a decode step at each
batch size against a step that also verifies ``K`` draft tokens per sequence,
the per-position ``verify_cost`` that implies, and the acceptance rate at which
speculation breaks even there (above it, speculation wins).

Greedy decoding, so every engine must produce the same tokens (checked).
Reports tokens/s (median round), the speed-up (median of the rounds' ratios), the acceptance rate (accepted / proposed draft
tokens) and the mean tokens committed per verified draft. On random weights a
model copies nothing: acceptance there comes from the loops greedy decoding of a
random model falls into, and says little about a trained checkpoint (``--model``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. Members agreed "
    "that the library needs new shelves, that the park benches should be repainted, and that "
    "the community hall roof must be repaired before the winter rains arrive.",
    "To install the package, download the archive, unpack it into a folder of your choice, and "
    "run the setup script from that folder. The script checks the dependencies, builds the "
    "native extension, and copies the command line tool into your path.",
    "Our quarterly results show revenue growth of twelve percent, driven by strong demand in "
    "the northern region. Operating costs rose by four percent, mainly because of higher "
    "shipping prices, and the margin improved for the third quarter in a row.",
    "The river rises in the mountains, flows east through the valley towns, and reaches the sea "
    "after three hundred kilometres. Its water feeds the farms along the banks, and its old "
    "mills now house museums, cafes and a small school of traditional crafts.",
]
CHAT = [
    "What should I cook for dinner tonight?", "Explain how a bicycle gear works.",
    "Write a short poem about the sea.", "What are good habits for learning a language?",
    "How do I fix a slow laptop?", "Tell me a fun fact about owls.",
    "Give me three ideas for a weekend trip.", "Why is the sky blue?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model folder or 'default' (SmolLM2-135M-Instruct); default: the bench preset")
    p.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    p.add_argument("--no-adaptive", action="store_true", help="always draft K tokens")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="draft with this checkpoint (same vocabulary) instead of prompt lookup")
    p.add_argument("--draft-layers", default=None, metavar="N[,N...]",
                   help="draft with the target's first N layers (one engine per N; "
                        "see tandem draft truncate)")
    p.add_argument("--ngram", action="store_true",
                   help="also run prompt lookup when drafting with a model")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV cache per engine")
    p.add_argument("--rounds", type=int, default=3, help="interleaved on/off repetitions (medians)")
    p.add_argument("--workloads", default="edit,chat,oracle")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cost-steps", type=int, default=30,
                   help="decode steps timed per batch size for the step costs (0: skip)")
    p.add_argument("--json", default=None, help="also write the results to this file")


def edit_prompt(passage: str) -> str:
    """A rewrite request quoting ``passage``: the answer is mostly a copy of it."""
    return ("Rewrite the following text with British spelling. Change nothing else.\n\n"
            f"{passage}")


def workload_prompts(name: str, tokenizer, n: int, seed: int) -> list[list[int]]:
    """``n`` chat prompts (token ids) of workload ``edit``/``oracle`` or ``chat``."""
    rng = random.Random(seed)
    if name in ("edit", "oracle"):
        messages = [edit_prompt(PASSAGES[i % len(PASSAGES)]) for i in range(n)]
    elif name == "chat":
        messages = [CHAT[(i + rng.randrange(len(CHAT))) % len(CHAT)] for i in range(n)]
    else:
        raise ValueError(f"unknown workload {name!r}: edit, chat or oracle")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}],
                                           add_generation_prompt=True) for m in messages]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


class ReplayProposer:
    """Drafts the known continuation of each request (the ``oracle`` workload)."""

    def __init__(self, outputs: dict[str, list[int]], prompt_lens: dict[str, int]) -> None:
        self.outputs, self.prompt_lens = outputs, prompt_lens

    def propose(self, seq_id: str, token_ids, k: int) -> list[int]:
        done = len(token_ids) - self.prompt_lens[seq_id]
        return self.outputs[seq_id][done:done + k]

    def drop(self, seq_id: str) -> None:
        pass


class FixedProposer:
    """Drafts ``k`` copies of one token: the cost of verifying, whatever is accepted."""

    def propose(self, seq_id: str, token_ids, k: int) -> list[int]:
        return [token_ids[-1]] * k

    def drop(self, seq_id: str) -> None:
        pass


def break_even_rate(ratio: float, k: int) -> float:
    """Acceptance rate ``a`` with ``1 + a + ... + a^k == ratio`` (bisection; 1.0 if never)."""
    lo, hi = 0.0, 1.0
    if k + 1 <= ratio:
        return 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def step_costs(plain, spec, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Median seconds of a plain decode step and of a verifying one, interleaved."""
    from tandem.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    times: dict[int, list[float]] = {0: [], 1: []}
    engines = (plain, spec)
    for j, eng in enumerate(engines):
        for i, p in enumerate(prompts):
            eng.add_request(f"cost{j}-{i}", p, params)
        while any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running) or eng.num_waiting:
            eng.step()
    for _ in range(steps):
        for j, eng in enumerate(engines):
            t0 = time.perf_counter()
            eng.step()
            times[j].append(time.perf_counter() - t0)
    for j, eng in enumerate(engines):
        for i in range(len(prompts)):
            eng.abort(f"cost{j}-{i}")
    return statistics.median(times[0]), statistics.median(times[1])


def run_batch(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, list]:
    """Seconds to finish ``prompts`` together (greedy, exactly ``output_len`` tokens each)."""
    from tandem.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return time.perf_counter() - t0, [out[rid] for rid in ids]


def spec_variants(args: argparse.Namespace, path: str) -> dict[str, dict]:
    """The speculative engines to compare with the plain one: name -> SpeculativeConfig kwargs.

    ``ngram`` (prompt lookup) unless only drafts are asked for, ``draft`` for
    ``--draft-model`` and ``draftN`` for each depth of ``--draft-layers`` (the
    target's first N layers: ``spec/truncated_draft.py``).
    """
    from tandem.engine.spec.truncated_draft import truncated_draft_path

    drafts: dict[str, str] = {}
    if args.draft_model:
        drafts["draft"] = args.draft_model
    for n in [int(x) for x in (args.draft_layers or "").split(",") if x]:
        drafts[f"draft{n}"] = str(truncated_draft_path(path, n))
    out = {"ngram": dict(method="ngram")} if args.ngram or not drafts else {}
    out.update({name: dict(method="draft", draft_model=d) for name, d in drafts.items()})
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.runinfo import describe
    from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from tandem.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = spec_variants(args, path)
    common = dict(num_speculative_tokens=args.num_speculative_tokens, adaptive=not args.no_adaptive,
                  max_batch_size=max(sizes))

    def engine(spec: SpeculativeConfig) -> LLMEngine:
        return LLMEngine(EngineConfig(model=path, num_threads=args.threads,
                                      cache=CacheConfig(memory_gb=args.kv_cache_gb),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=4096),
                                      speculative=spec))

    engines = {"off": engine(SpeculativeConfig())}
    engines.update({name: engine(SpeculativeConfig(**kw, **common)) for name, kw in variants.items()})
    tokenizer = engines["off"].tokenizer
    info = describe()
    result: dict = dict(model=path, variants={n: v.get("draft_model", "prompt lookup")
                                              for n, v in variants.items()},
                        output_len=args.output_len, threads=args.threads,
                        k=args.num_speculative_tokens, adaptive=not args.no_adaptive,
                        run=info, rows=[])
    print(f"model {path}, {args.threads} threads, K={args.num_speculative_tokens}"
          f"{'' if args.no_adaptive else ' (adaptive)'}, {args.output_len} tokens per request")
    for name, v in result["variants"].items():
        print(f"  {name}: drafts from {v}")
    print(f"machine: {info['machine']['cpu']}, load {info['machine']['load_avg_at_start']}")
    print(f"{'workload':8} {'variant':>8} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} "
          f"{'speed-up':>8} {'accept':>7} {'tok/draft':>9} {'same':>5}")
    names = list(variants)
    for workload in [w for w in args.workloads.split(",") if w]:
        for bs in sizes:
            prompts = workload_prompts(workload, tokenizer, bs, seed=bs)
            for name, eng in engines.items():
                run_batch(eng, prompts[:1], 4, f"warm-{name}")
            runs = ["off"] + (names[:1] if workload == "oracle" else names)
            if workload == "oracle":
                _, ref = run_batch(engines["off"], prompts, args.output_len, "ref")
                spec = engines[runs[1]].speculator
                proposer, spec.proposer = spec.proposer, ReplayProposer(
                    {f"{runs[1]}{r}-{i}": ref[i] for r in range(args.rounds) for i in range(bs)},
                    {f"{runs[1]}{r}-{i}": len(p) for r in range(args.rounds)
                     for i, p in enumerate(prompts)})
            secs: dict[str, list[float]] = {name: [] for name in runs}
            tokens: dict[str, list] = {}
            before = {n: _counters(engines[n]) for n in runs[1:]}
            for r in range(args.rounds):  # interleaved: off, a, b, ..., then reversed
                for name in (runs if r % 2 == 0 else runs[::-1]):
                    s, toks = run_batch(engines[name], prompts, args.output_len, f"{name}{r}")
                    secs[name].append(s)
                    tokens[name] = toks
            if workload == "oracle":
                spec.proposer = proposer
            total = bs * args.output_len  # per round
            for name in runs[1:]:
                proposed, accepted, drafts = (a - b for a, b in zip(_counters(engines[name]),
                                                                      before[name]))
                row = dict(workload=workload, variant=name, batch=bs,
                           off_tok_s=total / statistics.median(secs["off"]),
                           on_tok_s=total / statistics.median(secs[name]),
                           proposed=proposed, accepted=accepted,
                           acceptance=accepted / proposed if proposed else 0.0,
                           tokens_per_draft=(accepted + drafts) / drafts if drafts else 0.0,
                           identical=tokens["off"] == tokens[name])
                # median of each round's ratio: a load spike on the shared machine
                # skews one round, not the figure
                row["speedup"] = statistics.median(o / t for o, t in zip(secs["off"], secs[name]))
                result["rows"].append(row)
                print(f"{workload:8} {name:>8} {bs:5d} {row['off_tok_s']:10.1f} "
                      f"{row['on_tok_s']:10.1f} {row['speedup']:7.2f}x {row['acceptance']:7.2f} "
                      f"{row['tokens_per_draft']:9.2f} {'yes' if row['identical'] else 'NO':>5}")
    if args.cost_steps > 0:
        result["step_costs"] = report_step_costs(engines["off"], engine, tokenizer, sizes, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["identical"] for r in result["rows"]) else 1


def model_path(model: str | None) -> str:
    """``--model``: a folder, ``default`` (SmolLM2-135M-Instruct) or, if absent, the bench preset."""
    from tandem.engine.default_model import default_model_path
    from tandem.engine.model_source import resolve_model

    if model is None:
        return str(default_model_path("bench"))
    return str(resolve_model(None if model == "default" else model).path)


def _counters(engine) -> tuple[int, int, int]:
    s = engine.speculator
    return s.num_proposed, s.num_accepted, s.num_drafts


def report_step_costs(plain, make_engine, tokenizer, sizes: list[int], args) -> list[dict]:
    """Median plain decode step vs one verifying K fixed drafts per sequence, per batch size."""
    from tandem.common.config import SpeculativeConfig

    k = args.num_speculative_tokens
    fixed = make_engine(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                          adaptive=False, max_batch_size=max(sizes)))
    fixed.speculator.proposer = FixedProposer()
    rows = []
    print(f"\nstep costs: median of {args.cost_steps} interleaved decode steps, "
          f"plain vs verifying K={k} drafts per sequence")
    print(f"{'batch':>5} {'plain ms':>9} {'verify ms':>9} {'ratio':>6} {'verify_cost':>11} "
          f"{'break-even acceptance':>22}")
    for bs in sizes:
        prompts = workload_prompts("chat", tokenizer, bs, seed=bs)
        t_plain, t_spec = step_costs(plain, fixed, prompts, args.cost_steps)
        ratio = t_spec / t_plain
        row = dict(batch=bs, plain_ms=1e3 * t_plain, verify_ms=1e3 * t_spec, ratio=ratio,
                   verify_cost=(ratio - 1) / k, break_even_acceptance=break_even_rate(ratio, k))
        rows.append(row)
        print(f"{bs:5d} {row['plain_ms']:9.2f} {row['verify_ms']:9.2f} {ratio:6.2f} "
              f"{row['verify_cost']:11.3f} {row['break_even_acceptance']:22.2f}")
    return rows
