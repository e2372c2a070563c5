"""``tandem serve``: start (or join) Ray, the pools and the gateway; drain on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

from services.common.config import KV_IN_PLACE_MIN_BYTES

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="a model folder, a .gguf file or a Hugging Face repo id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the model's own name)")
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated", "conditional"])
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted bearer token (repeatable; also $TANDEM_API_KEY)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--cpus-per-worker", type=float, default=0.0)
    p.add_argument("--prefill-nice", type=int, default=0, metavar="N",
                   help="CPU hosts the pools share: run prefill workers at niceness N (0-19) so "
                   "decode steps get the CPU first (0: off)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0)
    p.add_argument("--prefill-accelerator-type", default=None)
    p.add_argument("--decode-accelerator-type", default=None)
    p.add_argument("--prefill-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="custom Ray resource each prefill worker asks for (repeatable)")
    p.add_argument("--decode-resource", action="append", default=[], metavar="NAME=AMOUNT")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache per worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--layer-group-size", type=int, default=2, help="layers per streamed KV group")
    p.add_argument("--local-prefill-threshold", type=int, default=64,
                   help="conditional mode: shorter prompts prefill on the decode worker")
    p.add_argument("--checksum", action="store_true", help="checksum every KV payload")
    p.add_argument("--kv-in-place-min-bytes", type=int, default=KV_IN_PLACE_MIN_BYTES,
                   metavar="N",
                   help="send KV block runs consecutive on both sides in place (no staging "
                   "copies) when a run's layer plane averages at least N bytes; -1: never")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="admission bound per worker; beyond it requests get 429")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)


def _resources(items: list[str]) -> tuple[tuple[str, float], ...]:
    out = []
    for item in items:
        name, sep, amount = item.partition("=")
        if not sep or not name:
            raise ValueError(f"a resource is NAME=AMOUNT, got {item!r}")
        out.append((name, float(amount)))
    return tuple(out)


def model_spec(args: argparse.Namespace) -> str | None:
    """MODEL, or ``--model``; naming two different models is an error."""
    positional, flag = getattr(args, "model_arg", None), args.model
    if positional and flag and positional != flag:
        raise ValueError(f"two models named: {positional!r} and --model {flag!r}")
    return positional or flag


def build_config(args: argparse.Namespace):
    from services.common.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig

    engine = EngineConfig(
        model=model_spec(args), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        cache=CacheConfig(block_size=args.block_size, memory_gb=args.kv_cache_gb),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens))
    return ClusterConfig(
        mode=args.mode, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        engine=engine, threads_per_worker=args.threads_per_worker,
        cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
        prefill_nice=args.prefill_nice,
        kv_in_place_min_bytes=None if args.kv_in_place_min_bytes < 0 else args.kv_in_place_min_bytes,
        prefill_accelerator_type=args.prefill_accelerator_type,
        decode_accelerator_type=args.decode_accelerator_type,
        prefill_resources=_resources(args.prefill_resource),
        decode_resources=_resources(args.decode_resource),
        layer_group_size=args.layer_group_size, checksum=args.checksum,
        local_prefill_threshold=args.local_prefill_threshold, ray_address=args.ray_address,
        max_queued_requests=args.max_queued_requests)


def main(args: argparse.Namespace) -> int:
    from services.cluster.backend import ClusterBackend
    from services.cluster.cluster import Cluster
    from services.engine.model.config import ModelConfig
    from services.engine.model_source import resolve_model
    from services.gateway.app import create_app
    from services.gateway.server import serve
    from services.text.tokenizer import Tokenizer

    def progress(msg: str) -> None:
        print(f"[tandem] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    config = build_config(args)
    progress(f"preparing {config.engine.model or 'the embedded default model'}")
    resolved = resolve_model(config.engine.model)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=str(resolved.path)))
    model = config.engine.model
    mc = ModelConfig.from_dir(model)
    tokenizer = Tokenizer.from_dir(model)
    max_len = min(config.engine.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    keys = list(args.api_key or [])
    if os.environ.get("TANDEM_API_KEY"):
        keys.append(os.environ["TANDEM_API_KEY"])
    cluster = Cluster(config, progress=progress).start()
    try:
        name = args.served_model_name or resolved.name
        backend = ClusterBackend(cluster, name, max_len, mc.vocab_size)
        app = create_app(backend, tokenizer, api_keys=keys, max_body_bytes=args.max_body_bytes,
                         request_timeout_s=args.request_timeout)
        progress(f"ready in {time.perf_counter() - t0:.1f}s: serving {name!r} "
                 f"({config.mode}, {config.prefill_workers}P+{config.decode_workers}D) "
                 f"at http://{args.host}:{args.port}/v1")
        serve(app, args.host, args.port, log_level="warning", access_log=False)
    finally:
        progress("shutting down")
        cluster.shutdown()
    return 0
