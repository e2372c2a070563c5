"""``tandem serve``: start (or join) Ray, the pools and the gateway; drain on SIGINT/SIGTERM.

While it serves, it keeps a record of itself where ``tandem drain`` and ``tandem scale``
on this machine find it (``tandem.cluster.local_serves``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from tandem.common.flags import add_config_flags, config_from_args
from tandem.common.config import ClusterConfig

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
                   help="accepted bearer token (repeatable; also $TANDEM_API_KEY). Visible in "
                   "the process list: prefer --api-key-file")
    p.add_argument("--api-key-file", action="append", default=None, metavar="PATH",
                   help="file of accepted bearer tokens, one per line (repeatable; also "
                   "$TANDEM_API_KEY_FILE), e.g. a mounted Kubernetes Secret")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key (refused otherwise)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="/metrics needs the API key too (default: open, like /health and /ready)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--deployment", metavar="NAME",
                   help="run the workers as detached Ray actors named after NAME: they outlive "
                   "this gateway, and a gateway restarted with the same NAME (and --ray-address) "
                   "re-attaches to them instead of loading the model again")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, finish in-flight requests for up to S seconds; "
                   "streams still running then end with an error event and [DONE]")
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


def local_record(cluster, host: str, port: int):
    """What ``tandem drain`` on this machine needs to reach ``cluster``'s gateway."""
    import os

    import ray

    from tandem.cluster.local_serves import LocalServe, ray_token_source

    token_auth, token_path = ray_token_source()
    return LocalServe(pid=os.getpid(), control_name=cluster.control_name,
                      ray_address=cluster.config.ray_address or ray.get_runtime_context().gcs_address,
                      deployment=cluster.deployment, host=host, port=port,
                      token_auth=token_auth, token_path=token_path)


def main(args: argparse.Namespace) -> int:
    from tandem.cluster.api_keys import check_exposure, collect_keys
    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.cluster.local_serves import recorded
    from tandem.engine.model.config import ModelConfig
    from tandem.engine.model_source import resolve_model
    from tandem.gateway.app import create_app
    from tandem.gateway.server import serve
    from tandem.text.tokenizer import Tokenizer

    def progress(msg: str) -> None:
        print(f"[tandem] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    keys = collect_keys(args.api_key, args.api_key_file)
    if args.metrics_require_key and not keys:
        raise ValueError("--metrics-require-key needs an API key (--api-key-file, --api-key)")
    warning = check_exposure(args.host, keys, args.allow_unauthenticated)
    if warning:
        progress(warning)
    config = build_config(args)
    progress(f"preparing {config.engine.model or 'the embedded default model'}")
    resolved = resolve_model(config.engine.model)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=str(resolved.path)))
    model = config.engine.model
    mc = ModelConfig.from_dir(model)
    tokenizer = Tokenizer.from_dir(model)
    max_len = min(config.engine.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    cluster = Cluster(config, progress=progress, deployment=args.deployment).start()
    try:
        name = args.served_model_name or resolved.name
        backend = ClusterBackend(cluster, name, max_len, mc.vocab_size)
        app = create_app(backend, tokenizer, api_keys=keys, max_body_bytes=args.max_body_bytes,
                         request_timeout_s=args.request_timeout,
                         metrics_require_key=args.metrics_require_key)
        progress(f"ready in {time.perf_counter() - t0:.1f}s: serving {name!r} "
                 f"({config.mode}, {config.prefill_workers}P+{config.decode_workers}D) "
                 f"at http://{args.host}:{args.port}/v1")
        with recorded(local_record(cluster, args.host, args.port)):
            serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout,
                  log_level="warning", access_log=False)
    finally:
        progress("shutting down")
        cluster.shutdown()
    return 0
