"""Benchmark workloads: length distributions, seeded synthetic mixes with exact prompt
lengths, presets, and local JSON/JSONL datasets (ShareGPT-style included)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tandem.bench import dataset
from tandem.bench.workload import (PRESETS, LengthDist, RequestClass, get_preset, ordinary_token_ids,
                                     synthetic)


def test_length_distributions_parse_and_sample_in_range():
    rng = np.random.default_rng(0)
    fixed = LengthDist.parse("128")
    assert (fixed.kind, fixed.low, fixed.high) == ("fixed", 128, 128)
    assert fixed.sample(rng, 3) == [128, 128, 128] and str(fixed) == "128"
    uni = LengthDist.parse("uniform:10-20")
    xs = uni.sample(rng, 5000)
    assert min(xs) == 10 and max(xs) == 20  # both ends included
    assert np.mean(xs) == pytest.approx(15, abs=0.3) and uni.mean() == 15
    assert str(uni) == "uniform:10-20" and LengthDist.parse(7).low == 7
    for bad in ("0", "uniform:5-2", "normal:3", "uniform:a-b", "-4", ""):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def _mix():
    return [RequestClass("short", 0.75, LengthDist.parse("uniform:4-8"), LengthDist.parse("32")),
            RequestClass("long", 0.25, LengthDist.parse("300"), LengthDist.parse("uniform:1-4"))]


def test_synthetic_prompts_have_exact_lengths_from_the_pool():
    pool = list(range(100, 120))
    reqs = synthetic(_mix(), 400, seed=3, token_ids=pool)
    assert [r.index for r in reqs] == list(range(400))
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert set(r.prompt) <= set(pool)
        if r.kind == "long":
            assert r.prompt_len == 300 and 1 <= r.output_len <= 4
        else:
            assert 4 <= r.prompt_len <= 8 and r.output_len == 32
    share = Counter(r.kind for r in reqs)["long"] / 400
    assert share == pytest.approx(0.25, abs=0.06)


def test_synthetic_is_reproducible_and_salted_per_rate():
    pool = list(range(16, 1000))
    a = synthetic(_mix(), 30, seed=1, token_ids=pool)
    assert a == synthetic(_mix(), 30, seed=1, token_ids=pool)
    assert synthetic(_mix(), 10, seed=1, token_ids=pool) == a[:10]  # a shorter run is a prefix
    other_seed = synthetic(_mix(), 30, seed=2, token_ids=pool)
    assert [r.prompt for r in other_seed] != [r.prompt for r in a]
    salted = synthetic(_mix(), 30, seed=1, token_ids=pool, salt=1)
    # same shapes (classes and lengths), fresh prompts: no prefix-cache hits across rates
    assert [(r.kind, r.prompt_len, r.output_len) for r in salted] == [(r.kind, r.prompt_len, r.output_len) for r in a]
    assert all(x.prompt != y.prompt for x, y in zip(a, salted))


def test_synthetic_prompts_of_another_run_are_fresh():
    pool = list(range(16, 1000))
    a = synthetic(_mix(), 30, seed=1, token_ids=pool, run=5)
    b = synthetic(_mix(), 30, seed=1, token_ids=pool, run=6)
    assert [(r.kind, r.prompt_len, r.output_len) for r in b] == [(r.kind, r.prompt_len, r.output_len) for r in a]
    assert all(x.prompt != y.prompt for x, y in zip(a, b))
    assert synthetic(_mix(), 30, seed=1, token_ids=pool, run=5) == a


def _bench_plan(*argv: str):
    import argparse

    from tandem.bench import serve as serve_bench

    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    return serve_bench.plan(parser.parse_args(["--url", "http://x", *argv]))


def test_each_run_draws_fresh_prompts_unless_its_salt_is_given():
    # a long-lived server (vLLM keeps a prefix cache) must not find a repeated run's prompts
    first, second = _bench_plan("--preset", "interference"), _bench_plan("--preset", "interference")
    assert first.config["prompt_salt"] != second.config["prompt_salt"]
    for k in range(len(first.rates)):
        a, b = first.requests(k), second.requests(k)
        assert [(r.kind, r.prompt_len, r.output_len) for r in a] == [(r.kind, r.prompt_len, r.output_len) for r in b]
        assert all(x.prompt != y.prompt for x, y in zip(a, b))
    replay = _bench_plan("--preset", "interference", "--prompt-salt", str(first.config["prompt_salt"]))
    assert all(replay.requests(k) == first.requests(k) for k in range(len(first.rates)))
    with pytest.raises(ValueError, match="--prompt-salt"):
        _bench_plan("--preset", "interference", "--prompt-salt", "-1")


def test_the_warmup_sends_each_class_longest_prompt_first_and_no_swept_prompt():
    plan = _bench_plan("--preset", "interference")
    warm = plan.warmup(4)
    assert [r.kind for r in warm[:2]] == ["long-prompt", "stream"] and warm[0].prompt_len == 1024
    assert len(warm) == 4 and plan.warmup(0) == [] and len(plan.warmup(1)) == 1
    swept = {tuple(r.prompt) for k in range(len(plan.rates)) for r in plan.requests(k)}
    assert not swept & {tuple(r.prompt) for r in warm}
    one_class = _bench_plan("--input-len", "uniform:8-300", "--num-prompts", "40")
    assert one_class.warmup(2)[0].prompt_len == max(r.prompt_len for r in one_class.requests(0)) > 250


def test_synthetic_errors():
    with pytest.raises(ValueError):
        synthetic([], 3, 0, [1, 2])
    with pytest.raises(ValueError):
        synthetic([RequestClass("x", 0.0, LengthDist.parse("1"), LengthDist.parse("1"))], 3, 0, [1])


def test_ordinary_token_ids_skip_special_tokens(tiny_model_dir):
    from tandem.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    ids = ordinary_token_ids(tok)
    assert ids and not set(ids) & set(tok.all_special_ids)
    assert max(ids) < tok.vocab_size
    assert ordinary_token_ids(None) == list(range(16, 1000))


def test_presets_are_defined_and_checked():
    assert {"chat", "interference"} <= set(PRESETS)
    inter = get_preset("interference")
    kinds = {c.name: c for c in inter.classes}
    # long prompts with few tokens out, among short-prompt long-output streams
    assert max(c.input_len.mean() for c in inter.classes) >= 8 * min(c.input_len.mean() for c in inter.classes)
    assert sum(c.weight for c in kinds.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="chat"):
        get_preset("nope")


def test_dataset_sharegpt_json_with_a_tokenizer(tmp_path, tiny_model_dir):
    from tandem.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    data = [{"conversations": [{"from": "human", "value": "Hello there, how are you?"},
                               {"from": "gpt", "value": "Fine, thanks for asking."}]},
            {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]},
            {"messages": [{"role": "user", "content": "What is two plus two?"},
                          {"role": "assistant", "content": "Four."}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = dataset.load(path, 4, seed=0, output_len=LengthDist.parse("9"), tokenizer=tok)
    assert len(reqs) == 4 and {r.kind for r in reqs} == {"dataset"}
    by_prompt = {tuple(r.prompt): r for r in reqs}
    hello = tok.encode("Hello there, how are you?")
    assert tuple(hello) in by_prompt
    assert by_prompt[tuple(hello)].prompt_len == len(hello)
    assert by_prompt[tuple(hello)].output_len == len(tok.encode("Fine, thanks for asking.", add_special_tokens=False))


def test_dataset_jsonl_without_a_tokenizer(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"just text"\n{"prompt": "with a length", "output_len": 5}\n\n{"other": 1}\n')
    reqs = dataset.load(path, 2, seed=0, output_len=LengthDist.parse("7"))
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [
        ("just text", None, 7), ("with a length", None, 5)]
    assert dataset.load(path, 2, 0, LengthDist.parse("7")) == reqs  # seeded
    with pytest.raises(FileNotFoundError):
        dataset.load(tmp_path / "missing.json", 1, 0, LengthDist.parse("7"))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError):
        dataset.load(empty, 1, 0, LengthDist.parse("7"))
