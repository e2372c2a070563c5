"""``tandem bench offline --vllm-python``: the interleaved harness, against a stand-in vLLM side.

The tandem side is the real engine (tiny preset) in its own process; the vLLM side is
``tests/fake_vllm_side.py`` behind an executable that stands where vLLM's Python would.
"""

from __future__ import annotations

import json
import os
import stat
import statistics
import sys
import tempfile
from pathlib import Path

import pytest

from tandem.bench.side_by_side import Series, cpu_list
from tandem.cli.main import main


@pytest.fixture(autouse=True)
def _side_logs_in_tmp_path(tmp_path, monkeypatch):
    """The harness keeps each run's side logs in a fresh temporary folder (its result names
    it); here that folder goes under the test's own, not the machine's /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _fake_python(tmp_path: Path, env: str = "") -> Path:
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\n{env} exec {sys.executable} -m tests.fake_vllm_side\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_interleaved_runs_against_a_stand_in(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "r.json"
    slow_then_fast = _fake_python(tmp_path, "FAKE_VLLM_TTFT_S=0.4,0.25,0.3")  # per TTFT call
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), "--vllm-python", str(slow_then_fast),
               "--threads", "1", "--runs", "3", "--num-prompts", "4", "--input-len", "16",
               "--output-len", "4", "--ttft-lens", "32,4096", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    # A B B A A B: each measured round alternates who goes first.
    assert r["order"] == ["tandem", "vllm", "vllm", "tandem", "tandem", "vllm"]
    t = r["throughput"]
    assert len(t["tandem"]["runs"]) == len(t["vllm"]["runs"]) == 3
    assert t["vllm"]["runs"] == [pytest.approx(4 * 4 / 0.5)] * 3  # the stand-in's fixed 0.5 s
    assert t["ratio_of_medians"] == pytest.approx(statistics.median(t["tandem"]["runs"]) / 32.0)
    assert t["tandem"]["min"] <= t["tandem"]["median"] <= t["tandem"]["max"]
    # The tiny preset's context is 2,048: the 4,096-token TTFT is clipped to 2,047.
    assert sorted(r["ttft"]) == ["2047", "32"]
    for s in r["ttft"].values():  # each round keeps each side's best of its 3 calls
        assert s["vllm"]["runs_s"] == [pytest.approx(0.25)] * 3
        assert s["ratio_of_medians"] == pytest.approx(0.25 / statistics.median(s["tandem"]["runs_s"]))
    assert r["greedy_total"] == 12
    # Same prompts and model, same thread count: the stand-in saw what vLLM would.
    fake = r["sides"]["vllm"]
    assert fake["request"]["model"] == str(tiny_model_dir) and fake["request"]["threads"] == 1
    assert fake["env"] == {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(1), "VLLM_CPU_KVCACHE_SPACE": "2",
                           "OMP_NUM_THREADS": "1"}
    printed = capsys.readouterr().out
    assert "machine: " in printed and "load average" in printed
    assert "tandem / vllm (medians)" in printed and "TTFT  2047 tokens" in printed
    assert "best of 3 calls per side" in printed


def test_each_call_waits_for_the_other_side_to_go_idle(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """A side still polling a core after its call (as vLLM does for about a second) would
    slow the next measurement of the other side: the driver waits for it to go idle.
    (How long the waits take is this machine's; ``wait_until_idle`` itself is tested in
    tests/unit/test_plan.py.)"""
    from tandem.bench import side_by_side
    from tandem.bench.side_protocol import Side

    events: list[tuple] = []  # ("wait", pid, seconds) and ("call", side, pid, op), in order

    def wait_until_idle(pid: int) -> float:
        waited = real_wait(pid)
        events.append(("wait", pid, waited))
        return waited

    def call(self, op, timeout_s, **fields):
        events.append(("call", self.name, self.pid, op))
        return real_call(self, op, timeout_s, **fields)
    real_wait, real_call = side_by_side.wait_until_idle, Side.call
    monkeypatch.setattr(side_by_side, "wait_until_idle", wait_until_idle)
    monkeypatch.setattr(Side, "call", call)
    out = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(tiny_model_dir),
               "--vllm-python", str(_fake_python(tmp_path, "FAKE_VLLM_SPIN_S=0.6")),
               "--threads", "1", "--runs", "1", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "2", "--ttft-lens", "16", "--dtype", "bfloat16", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    pids = {name: pid for kind, name, pid, _ in (e for e in events if e[0] == "call")}
    measured = [i for i, e in enumerate(events) if e[0] == "call" and e[3] in ("generate", "ttft")]
    assert {events[i][1] for i in measured} == {"tandem", "vllm"}
    for i in measured:  # right before each measured call: a wait for the other side, only
        other = next(name for name in pids if name != events[i][1])
        assert events[i - 1][:2] == ("wait", pids[other]), events[max(0, i - 3):i + 1]
    for name, pid in pids.items():  # each side's longest wait is reported
        assert r["settle_s"][name] == max(e[2] for e in events if e[0] == "wait" and e[1] == pid)
    assert r["sides"]["vllm"]["request"]["dtype"] == "bfloat16"  # both sides at the same precision
    assert "bfloat16" in capsys.readouterr().out


def test_a_side_that_fails_to_load_is_a_clear_error(tmp_path, tiny_model_dir, capsys):
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), "--threads", "1", "--runs", "1",
               "--vllm-python", str(_fake_python(tmp_path, "FAKE_VLLM_FAIL=load")),
               "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--ttft-lens", "16"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "vllm side: RuntimeError: fake vllm cannot load this model" in err


def test_a_side_dying_mid_run_keeps_the_whole_rounds(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), "--threads", "1", "--runs", "3",
               "--vllm-python", str(_fake_python(tmp_path, "FAKE_VLLM_FAIL=generate:4")),
               "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--ttft-lens", "16",
               "--json", str(out)])
    assert rc == 1  # warm-up and rounds 1-2 whole; round 3 lost with the side
    r = json.loads(out.read_text())
    assert r["rounds"] == 2 and len(r["throughput"]["tandem"]["runs"]) == 2
    assert len(r["ttft"]["16"]["vllm"]["runs_s"]) == 2
    assert "stopped after 2 of 3 rounds" in r["stopped"] and "fake vllm engine died" in r["stopped"]
    captured = capsys.readouterr()
    assert "INCOMPLETE" in captured.out and "tandem / vllm (medians)" in captured.out
    assert "stopped after 2 of 3 rounds" in captured.err


def test_bad_arguments(tmp_path, tiny_model_dir):
    base = ["bench", "offline", "--model", str(tiny_model_dir)]
    assert main([*base, "--vllm-python", str(tmp_path / "missing")]) == 2
    fake = str(_fake_python(tmp_path))
    assert main([*base, "--vllm-python", fake, "--runs", "0"]) == 2
    assert main([*base, "--vllm-python", fake, "--ttft-repeats", "0"]) == 2
    assert main([*base, "--vllm-python", fake, "--ttft-lens", "1k"]) == 2
    assert main([*base, "--vllm-python", fake, "--input-len", "2000", "--output-len", "100"]) == 2


def test_series_summary():
    s = Series("throughput", "tok/s", {"tandem": [10.0, 30.0, 20.0], "vllm": [10.0, 10.0, 40.0]})
    out = s.summary()
    assert out["tandem"]["median"] == 20.0 and out["vllm"]["median"] == 10.0
    assert out["ratio_of_medians"] == 2.0
    assert out["round_ratios"] == [1.0, 3.0, 0.5]
    assert (out["vllm"]["min"], out["vllm"]["max"]) == (10.0, 40.0)


def test_more_threads_than_cpus_is_refused():
    with pytest.raises(ValueError, match="CPUs are usable"):
        cpu_list(len(os.sched_getaffinity(0)) + 1)


def test_the_batch_one_step_is_set_against_reads_taken_between_the_steps(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), "--no-hf", "--threads", "1",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--decode-steps", "6",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["decode_step_ms"] > 0 and 0 < res["read_gb_s"] <= res["best_read_gb_s"]
    assert 0 < res["kv_mb"] < res["weight_mb"]  # ~11.5 tokens of K/V a step
    assert res["decode_floor_ms"] == pytest.approx((res["weight_mb"] + res["kv_mb"]) / res["read_gb_s"])
    assert res["decode_vs_floor"] == pytest.approx(res["decode_floor_ms"] / res["decode_step_ms"])
    assert res["decode_vs_best_floor"] <= res["decode_vs_floor"]
    assert "the median read between the steps" in capsys.readouterr().out
    assert main(["bench", "offline", "--model", str(tiny_model_dir), "--no-hf", "--decode-steps", "1"]) == 2


def test_the_engine_alone_runs_in_the_dtype_asked(tmp_path, tiny_model_dir, capsys):
    """Without --vllm-python, --dtype bfloat16 is tandem's engine in bf16 (half the weight
    bytes a decode step reads), said beside the figures."""
    def run(dtype: str) -> dict:
        out = tmp_path / f"{dtype}.json"
        assert main(["bench", "offline", "--model", str(tiny_model_dir), "--no-hf", "--threads", "1",
                     "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--decode-steps", "4",
                     "--dtype", dtype, "--json", str(out)]) == 0
        return json.loads(out.read_text())

    full, half = run("float32"), run("bfloat16")
    assert (full["dtype"], half["dtype"]) == ("float32", "bfloat16")
    assert half["weight_mb"] == pytest.approx(full["weight_mb"] / 2, rel=0.05)  # bf16 blocks pad a little
    printed = capsys.readouterr().out
    assert "threads, float32 (packed layout)" in printed and "threads, bfloat16 (" in printed


def test_sampled_runs_ask_both_sides_to_sample_and_compare_no_outputs(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), "--vllm-python", str(_fake_python(tmp_path)),
               "--threads", "1", "--runs", "1", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "2", "--ttft-lens", "16", "--temperature", "0.8", "--top-p", "0.95",
               "--json", str(out)])
    assert rc == 0
    request = json.loads(out.read_text())["sides"]["vllm"]["request"]
    assert (request["temperature"], request["top_p"]) == (0.8, 0.95)
    printed = capsys.readouterr().out
    assert "sampled at temperature 0.8, top-p 0.95" in printed and "outputs not compared" in printed
    assert "greedy outputs identical" not in printed


@pytest.mark.parametrize("flags", [["--temperature", "2.5"], ["--top-p", "0"]])
def test_sampling_flags_out_of_range_are_refused(tiny_model_dir, flags, capsys):
    assert main(["bench", "offline", "--model", str(tiny_model_dir), "--no-hf", *flags]) == 2
    assert "--temperature must be in [0, 2]" in capsys.readouterr().err
