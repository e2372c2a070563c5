"""CLI flags and LLM keywords come from the config dataclasses: one default per setting,
bad choices refused at parse time, MODEL positional with --model as its alias."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.cli.main import build_parser, main
from tandem.cli.serve import build_config
from tandem.common.config import (
    CacheConfig, ClusterConfig, ClusterMode, EngineConfig, SchedulerConfig, TransferBackend)
from tandem.common.config_fields import build_from_keywords, settings
from tandem.router.config import RouterConfig


def _serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_defaults_are_the_dataclass_defaults():
    assert build_config(_serve()) == ClusterConfig()


def test_every_cluster_setting_has_a_flag_that_reaches_the_config():
    changed = {"mode": "conditional", "prefill_workers": "3", "max_num_seqs": "7", "memory_gb": "0.5",
               "enable_prefix_caching": None, "transfer_backend": "nccl", "local_prefill_threshold": "9",
               "dtype": "bfloat16", "device": "cuda:1", "max_model_len": "100"}
    flags = {s.name: s.flag for s in settings(ClusterConfig)}
    argv = []
    for name, value in changed.items():
        argv += [flags[name].replace("--", "--no-") if value is None else flags[name]]
        argv += [] if value is None else [value]
    cfg = build_config(_serve(*argv))
    assert cfg.mode is ClusterMode.CONDITIONAL and cfg.transfer_backend is TransferBackend.NCCL
    assert (cfg.prefill_workers, cfg.local_prefill_threshold) == (3, 9)
    assert cfg.engine.scheduler.max_num_seqs == 7 and cfg.engine.cache.memory_gb == 0.5
    assert cfg.engine.cache.enable_prefix_caching is False
    assert (cfg.engine.dtype, cfg.engine.device, cfg.engine.max_model_len) == ("bfloat16", "cuda:1", 100)


def test_special_values():
    cfg = build_config(_serve("--kv-in-place-min-bytes", "-1", "--layer-group-size", "-1",
                              "--prefill-resource", "fast=1", "--prefill-resource", "big=0.5"))
    assert cfg.kv_in_place_min_bytes is None and cfg.layer_group_size is None
    assert cfg.prefill_resources == (("fast", 1.0), ("big", 0.5))


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--device", "tpu"], "device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--mode", "split"], "invalid choice: 'split'"),
    (["--prefill-resource", "gpu"], "a resource is NAME=AMOUNT"),
    (["--block-size", "big"], "invalid int value"),
    (["--decode-weight-layout", "dense"], "invalid choice: 'dense'"),
    (["--prefill-weight-layout", "dense"], "invalid choice: 'dense'"),
])
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _serve(*argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_model_positional_and_alias(capsys):
    assert build_config(_serve("some/folder")).engine.model == "some/folder"
    assert build_config(_serve("--model", "x.gguf")).engine.model == "x.gguf"
    assert build_config(_serve("a", "--model", "a")).engine.model == "a"
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two models named: 'a' and --model 'b'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("tandem ")


def test_generate_flags_build_the_engine_config():
    from tandem.common.flags import config_from_args

    args = build_parser().parse_args(["generate", "m", "--max-num-batched-tokens", "64", "--threads", "2",
                                      "--seed", "5"])
    cfg = config_from_args(args, EngineConfig, args.engine_settings, {("model",): "m"})
    assert cfg == EngineConfig(model="m", num_threads=2,
                               scheduler=SchedulerConfig(max_num_batched_tokens=64))
    assert args.sample_seed == 5  # --seed is the sampling seed there


def test_llm_keywords_are_the_engine_settings():
    cfg = build_from_keywords(EngineConfig, {"kv_cache_memory_gb": 2.0, "block_size": 8,
                                             "enable_chunked_prefill": False}, model="m")
    assert cfg == EngineConfig(model="m", cache=CacheConfig(block_size=8, memory_gb=2.0),
                               scheduler=SchedulerConfig(enable_chunked_prefill=False))
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_cache_gb'"):
        build_from_keywords(EngineConfig, {"kv_cache_gb": 1})
    with pytest.raises(TypeError, match="'role'"):  # internal: not a keyword
        build_from_keywords(EngineConfig, {"role": "prefill"})


def test_router_and_cluster_share_their_defaults():
    router, cluster = RouterConfig(), ClusterConfig()
    assert router.local_prefill_threshold == cluster.local_prefill_threshold
    assert router.max_queued_requests == cluster.max_queued_requests
    assert router.mode == cluster.mode


def test_configs_validate_choices():
    with pytest.raises(ValueError, match="mode must be one of disaggregated, colocated, conditional"):
        ClusterConfig(mode="split")
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'; choose one of auto, float32"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="gpu")
    with pytest.raises(ValueError, match="decode_weight_layout must be one of packed, blocked, plain"):
        ClusterConfig(decode_weight_layout="dense")
    assert build_config(_serve("--decode-weight-layout", "plain")).decode_weight_layout == "plain"
    with pytest.raises(ValueError, match="prefill_weight_layout must be one of packed, blocked, plain"):
        ClusterConfig(prefill_weight_layout="dense")
    assert ClusterConfig().prefill_weight_layout is None  # by dtype: ClusterConfig.pool_layout
    assert build_config(_serve("--prefill-weight-layout", "packed")).prefill_weight_layout == "packed"
    assert dataclasses.replace(ClusterConfig(), mode="colocated", prefill_workers=0).mode is ClusterMode.COLOCATED


def _subcommands(parser, path=()):
    """Every (sub)command's parser, by its path of names."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def test_every_commands_help_renders():
    """argparse formats help strings with %: a stray one breaks `--help` of that command."""
    commands = list(_subcommands(build_parser()))
    assert len(commands) > 5
    for path, parser in commands:
        text = parser.format_help()
        assert text.startswith("usage:"), path
