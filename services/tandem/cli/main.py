"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from tandem.common.flags import config_from_args
    from tandem.common.config import EngineConfig
    from tandem.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    model = args.model_arg or args.model
    print(f"loading {model or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    llm = LLM.from_config(config_from_args(args, EngineConfig, args.engine_settings, {("model",): model}))
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.sample_seed, top_p=args.top_p)
    prompts = args.prompt or ["The quick brown fox", "def fibonacci(n):"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        print(f"--- {prompt!r} ({len(out.prompt_token_ids)} prompt tokens)")
        print(f"{comp.text!r}  [{len(comp.token_ids)} tokens, {comp.finish_reason.value}]")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from tandem.engine.default_model import write_model

    path = write_model(args.preset, args.out, seed=args.seed)
    print(path)
    return 0


def _draft_truncate(args: argparse.Namespace) -> int:
    from tandem.engine.model_source import resolve_model
    from tandem.engine.spec.truncated_draft import truncated_draft_path, write_truncated_draft

    source = resolve_model(None if args.model in (None, "default") else args.model).path
    print(write_truncated_draft(source, args.layers, args.out) if args.out
          else truncated_draft_path(source, args.layers))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"tandem.bench.{args.bench.replace('-', '_')}").main(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    from tandem.common.flags import add_config_flags
    from tandem.common.config import EngineConfig

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with the engine")
    gen.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                     help="a model folder, a .gguf file or a Hugging Face repo id (default: the embedded model)")
    gen.add_argument("--model", default=None, help="same as MODEL")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", dest="sample_seed", type=int, default=None, help="sampling seed")
    engine = gen.add_argument_group("engine (defaults from EngineConfig)")
    gen.set_defaults(func=_generate, engine_settings=add_config_flags(engine, EngineConfig, exclude={"seed"}))

    from tandem.cli import serve as serve_cmd

    srv = sub.add_parser("serve", help="serve the OpenAI API on a disaggregated cluster")
    serve_cmd.add_arguments(srv)
    srv.set_defaults(func=serve_cmd.main)

    from tandem.cli import chat as chat_cmd

    chat = sub.add_parser("chat", help="chat in the terminal with a server (--url) or a local model")
    chat_cmd.add_arguments(chat)
    chat.set_defaults(func=chat_cmd.main)

    from tandem.cli import control

    drain = sub.add_parser("drain", help="take workers out of a running cluster without "
                           "cutting a stream (scale-down)")
    control.add_drain_arguments(drain)
    drain.set_defaults(func=control.drain_main)
    scale = sub.add_parser("scale", help="resize the prefill/decode pools of a running cluster")
    control.add_scale_arguments(scale)
    scale.set_defaults(func=control.scale_main)

    mk = sub.add_parser("make-model", help="write a seeded random checkpoint")
    mk.add_argument("--preset", default="small", choices=["tiny", "small", "bench"])
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=_make_model)

    draft = sub.add_parser("draft", help="draft models for --speculative draft")
    truncate = draft.add_subparsers(dest="draft", required=True).add_parser(
        "truncate", help="the target's first N layers + final norm + LM head, as a model folder")
    truncate.add_argument("--model", default="default", help="target: a folder, .gguf, repo id or default")
    truncate.add_argument("--layers", type=int, default=6, metavar="N",
                          help="decoder layers kept (default 6: no depth pays on CPU, see services/RESULTS.md)")
    truncate.add_argument("--out", default=None, help="folder to write (default: in the tandem cache)")
    truncate.set_defaults(func=_draft_truncate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from tandem.bench import (attention, compare, migrate, offline, request_path, spec, spec_placement, stream,
                              transfer)
    from tandem.bench import serve as serve_bench

    for name, module, text in (("offline", offline, "engine throughput vs HF transformers"),
                               ("attention", attention,
                                "native attention: decode's KV read rate, prompts' against SDPA"),
                               ("transfer", transfer, "KV transfer bandwidth and added TTFT"),
                               ("stream", stream, "per-token overhead and concurrent streams"),
                               ("serve", serve_bench, "TTFT/TPOT/goodput of a server under load"),
                               ("compare", compare, "disaggregated vs colocated (vs another server)"),
                               ("request-path", request_path, "a server's CPU per step and per token "
                                "outside the engine, at rest (for `plan`)"),
                               ("spec", spec, "speculative decoding on and off, batch 1/4/16"),
                               ("spec-placement", spec_placement, "where a draft model's prompt KV is made"),
                               ("migrate", migrate, "a request leaving its decode worker: moved with "
                                "its KV vs re-driven (pause, drain under load)")):
        sp = bench_sub.add_parser(name, help=text)
        module.add_arguments(sp)
        sp.set_defaults(func=_bench)
    from tandem.planner import plan as plan_cmd
    from tandem.planner import profile as profile_cmd

    prof = sub.add_parser("profile", help="measure step and KV transfer costs of the workers (for `plan`)")
    profile_cmd.add_arguments(prof)
    prof.set_defaults(func=profile_cmd.main)
    pl = sub.add_parser("plan", help="size the prefill/decode pools for a workload and an SLO from a profile")
    plan_cmd.add_arguments(pl)
    pl.set_defaults(func=plan_cmd.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tandem.bench.client import ServerUnusable  # a benchmark's server: a message, not a traceback

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ServerUnusable) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
