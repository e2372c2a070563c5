"""Where users turn speculation on and watch it: config, CLI flags, metric names, bench workloads."""

from __future__ import annotations

import pytest

from tandem.cli.main import build_parser
from tandem.cli.serve import build_config
from tandem.common.metrics import exported_names, worker_metrics


def test_serve_flags_build_a_speculative_engine_config():
    args = build_parser().parse_args(["serve", "--speculative", "ngram",
                                      "--num-speculative-tokens", "3"])
    spec = build_config(args).engine.speculative
    assert spec.enabled and spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert not build_config(build_parser().parse_args(["serve"])).engine.speculative.enabled
    args = build_parser().parse_args(["serve", "--speculative", "draft",
                                      "--speculative-draft-model", "/models/small"])
    spec = build_config(args).engine.speculative
    assert spec.method == "draft" and spec.draft_model == "/models/small"
    with pytest.raises(ValueError, match="draft_model"):
        build_config(build_parser().parse_args(["serve", "--speculative", "draft"]))


def test_bench_spec_is_registered():
    args = build_parser().parse_args(["bench", "spec", "--batch-sizes", "1,2"])
    assert args.bench == "spec" and args.batch_sizes == "1,2"


def test_speculation_metrics_are_exported():
    names = exported_names()
    assert {"tandem_spec_proposed_tokens_total", "tandem_spec_accepted_tokens_total",
            "tandem_spec_acceptance_length_bucket"} <= names
    m, registry = worker_metrics("decode", "d0")
    m.spec_acceptance_length.observe(3)
    assert registry.get_sample_value("tandem_spec_acceptance_length_bucket",
                                     {"role": "decode", "worker": "d0", "le": "3.0"}) == 1


def test_edit_workload_quotes_the_passage():
    from tandem.bench.spec import PASSAGES, edit_prompt

    assert edit_prompt(PASSAGES[0]).endswith(PASSAGES[0])


def test_draft_prefill_chunk_and_placement_bench_are_reachable():
    args = build_parser().parse_args(["serve", "--speculative", "draft", "--speculative-draft-model",
                                      "/models/small", "--speculative-draft-prefill-chunk", "32"])
    assert build_config(args).engine.speculative.draft_prefill_chunk == 32
    with pytest.raises(ValueError, match="draft_prefill_chunk"):
        build_config(build_parser().parse_args(["serve", "--speculative-draft-prefill-chunk", "0"]))
    args = build_parser().parse_args(["bench", "spec-placement", "--draft-layers", "6"])
    assert args.bench == "spec-placement" and args.draft_layers == 6
    args = build_parser().parse_args(["draft", "truncate"])
    assert args.model == "default" and args.layers == 6 and args.out is None
