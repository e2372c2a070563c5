"""Each kind of worker profiled and planned on its own CPU weight layout: the pools' steps
for disaggregated mixes, a colocated worker's (on --cpu-weight-layout) for colocated ones."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tandem.planner import profile as profile_mod
from tandem.planner.perf_model import attention_pairs
from tandem.planner.mix import Mix, helm_values
from tandem.planner.prediction import models
from tandem.planner.plan_validate import burst_args, server_layout_args
from tandem.cli.main import build_parser, main as cli
from tandem.cli.serve import build_config
from tandem.common.config import CPU_FP32_DTYPES, DTYPES, ClusterConfig, EngineConfig
from tandem.engine.model.loader import resolve_dtype


def test_each_kind_of_worker_gets_the_layout_the_cluster_gives_it():
    assert profile_mod.pool_layouts(ClusterConfig()) == {"prefill": "blocked", "decode": "packed",
                                                          "colocated": "packed"}
    cfg = ClusterConfig(engine=EngineConfig(cpu_weight_layout="blocked"), prefill_weight_layout="plain")
    assert profile_mod.pool_layouts(cfg) == {"prefill": "plain", "decode": "blocked", "colocated": "blocked"}
    cfg = ClusterConfig(decode_weight_layout="plain")
    assert profile_mod.pool_layouts(cfg) == {"prefill": "blocked", "decode": "plain", "colocated": "packed"}
    with pytest.raises(ValueError, match="role must be prefill, decode or colocated"):
        cfg.pool_layout("both")


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16"])
def test_a_bf16_prefill_pool_takes_the_cpu_weight_layout(dtype):
    """Packed bf16 runs prompts as fast on AMX, and the two pools then compute alike; fp32
    keeps oneDNN's blocked layout for prompts unless asked otherwise."""
    layouts = profile_mod.pool_layouts(ClusterConfig(engine=EngineConfig(dtype=dtype)))
    assert layouts == {"prefill": "packed", "decode": "packed", "colocated": "packed"}
    cfg = ClusterConfig(engine=EngineConfig(dtype=dtype, cpu_weight_layout="plain"))
    assert cfg.pool_layout("prefill") == "plain"
    cfg = ClusterConfig(engine=EngineConfig(dtype=dtype), prefill_weight_layout="blocked")
    assert cfg.pool_layout("prefill") == "blocked"
    for fp32 in ("auto", "float32", "fp32"):
        assert ClusterConfig(engine=EngineConfig(dtype=fp32)).pool_layout("prefill") == "blocked"


def test_the_fp32_dtypes_are_those_the_loader_keeps_fp32_on_cpu():
    cpu = torch.device("cpu")
    for name in DTYPES:  # resolve_dtype reads the checkpoint's config for auto on GPU only
        assert (resolve_dtype(name, None, cpu) == torch.float32) == (name in CPU_FP32_DTYPES), name


def test_profile_takes_the_layout_flags_of_tandem_serve():
    args = build_parser().parse_args(["profile", "--prefill-weight-layout", "packed", "--decode-weight-layout",
                                      "plain", "--cpu-weight-layout", "blocked"])
    assert (args.prefill_weight_layout, args.decode_weight_layout, args.cpu_weight_layout) == \
        ("packed", "plain", "blocked")
    defaults = build_parser().parse_args(["profile"])
    assert (defaults.prefill_weight_layout, defaults.decode_weight_layout, defaults.cpu_weight_layout) == \
        (None, None, "packed")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--decode-weight-layout", "dense"])


def _prof(colocated: dict | None, prefill_cost: float = 4e-4) -> dict:
    def prefill(per_token):
        return [{"tokens": n, "seqs": 1, "pairs": attention_pairs(n), "seconds": 0.01 + per_token * n}
                for n in (16, 256, 1024)]

    def decode(per_seq):
        return [{"batch": b, "context": c, "seconds": 0.01 + per_seq * b} for b, c in ((1, 64), (8, 512), (32, 64))]

    pts = {"prefill": prefill(prefill_cost), "decode": decode(0.001),
           "mixed": [{"batch": 4, "context": 300, "prefill_tokens": 256, "seconds": 0.2}],
           "transfer": [{"bytes": b, "seconds": 1e-3 + b / 1e9} for b in (2**20, 2**24)]}
    if colocated is not None:
        pts["colocated"] = {kind: (prefill if kind == "prefill" else decode)(cost)
                            for kind, cost in colocated.items()}
    layouts = {"prefill": "blocked", "decode": "packed", "colocated": "packed"}
    return profile_mod.fit({
        "schema": profile_mod.SCHEMA, "hardware": {"cpu": "test CPU", "cores": 4, "device": "cpu"},
        "model": {"path": "unused"},
        "worker": {"threads_per_worker": 1, "prefill_nice": 0, **({"weight_layouts": layouts} if colocated else {})},
        "engine": {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 16, "num_blocks": 4096,
                   "kv_bytes_per_token": 16384}, "points": pts})


def test_colocated_mixes_are_planned_on_the_colocated_workers_own_steps():
    prof = _prof({"prefill": 8e-4})  # prompts on the colocated layout: twice the pool's per-token cost
    pools, colo = models(prof, colocated=False)[0], models(prof, colocated=True)[0]
    assert pools.prefill.per_token == pytest.approx(4e-4, rel=1e-6)
    assert colo.prefill.per_token == pytest.approx(8e-4, rel=1e-6)
    assert colo.decode == pools.decode  # its decode steps: the decode pool's layout, timed once
    # the mixed steps run on a colocated worker: predicted with its own models
    mixed = prof["points"]["mixed"][0]
    assert mixed["predicted_seconds"] == pytest.approx(colo.step(256, attention_pairs(256), 4, 300))
    prof = _prof({"decode": 0.002})
    assert models(prof, colocated=True)[0].decode.per_seq == pytest.approx(0.002, rel=1e-6)
    assert models(prof, colocated=True)[0].prefill == models(prof)[0].prefill
    # a profile from before the layouts: one set of steps for every mix
    old = _prof(None)
    assert "colocated" not in old["points"]
    assert models(old, colocated=True)[0] == models(old)[0]


def test_plan_simulates_colocated_mixes_on_their_layouts_steps(tmp_path, capsys):
    def ttft_p90(prof: dict, name: str) -> float:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(prof))
        out = tmp_path / name
        code = cli(["plan", "--profile", str(path), "--preset", "interference", "--num-prompts", "20", "--rates",
                    "1", "--repeats", "1", "--mixes", "colocatedx2", "--no-plots", "--out-dir", str(out)])
        assert code in (0, 1), capsys.readouterr().out
        result = json.loads((out / "plan.json").read_text())["results"][0]
        return result["runs"][0]["summary"]["ttft_ms"]["p90"]

    same, slower = ttft_p90(_prof({"prefill": 4e-4}), "same"), ttft_p90(_prof({"prefill": 1.2e-3}), "slower")
    assert slower > 2 * same  # the prompts' cost on the colocated layout, not the prefill pool's


def test_validation_serves_the_layouts_the_profile_timed():
    prof = _prof({"prefill": 8e-4})
    prof["worker"]["weight_layouts"] = {"prefill": "plain", "decode": "blocked", "colocated": "packed"}
    flags = server_layout_args(prof)
    cluster = build_config(build_parser().parse_args(["serve", *flags]))
    assert profile_mod.pool_layouts(cluster) == prof["worker"]["weight_layouts"]
    assert server_layout_args(_prof(None)) == []


@pytest.mark.parametrize("bursts", [{"prefill": 2, "decode": 2}, {"prefill": 0, "decode": 2}, {"prefill": 0, "decode": 0}])
def test_validation_serves_the_bursts_the_plan_simulated(bursts):
    args = ["serve", "--prefill-workers", "1", "--decode-workers", "1", *burst_args({"bursts": bursts})]
    cluster = build_config(build_parser().parse_args(args))
    assert (cluster.prefill_burst_threads, cluster.decode_burst_threads) == (bursts["prefill"], bursts["decode"])


def test_helm_values_carry_the_profiled_layouts_of_the_chosen_mix():
    layouts = {"prefill": "blocked", "decode": "plain", "colocated": "packed"}
    disagg = yaml.safe_load(helm_values(Mix(2, 1), "note", layouts))
    assert (disagg["prefill"]["weightLayout"], disagg["decode"]["weightLayout"]) == ("blocked", "plain")
    colo = yaml.safe_load(helm_values(Mix(0, 2, True), "note", layouts))
    assert colo["decode"]["weightLayout"] == "packed"  # the chart passes it as --cpu-weight-layout there
    assert "weightLayout" not in helm_values(Mix(1, 1), "note")  # a profile without layouts: the chart's defaults
