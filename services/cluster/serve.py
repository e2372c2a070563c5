"""``tandem serve``: start (or join) Ray, the pools and the gateway; drain on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

from services.cluster.flags import add_config_flags, config_from_args
from services.common.config import ClusterConfig

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="a model folder, a .gguf file or a Hugging Face repo id "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="same as MODEL")
    p.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the model's own name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted bearer token (repeatable; also $TANDEM_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    group = p.add_argument_group("cluster and engine (defaults from ClusterConfig / EngineConfig)")
    # the workers' torch threads come from --threads-per-worker
    p.set_defaults(config_settings=add_config_flags(group, ClusterConfig, exclude={"num_threads"}))


def model_spec(args: argparse.Namespace) -> str | None:
    """MODEL, or ``--model``; naming two different models is an error."""
    positional, flag = getattr(args, "model_arg", None), args.model
    if positional and flag and positional != flag:
        raise ValueError(f"two models named: {positional!r} and --model {flag!r}")
    return positional or flag


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """The cluster config the parsed flags describe."""
    return config_from_args(args, ClusterConfig, args.config_settings, {("engine", "model"): model_spec(args)})


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
