"""``tandem bench serve`` and ``tandem bench compare`` for real: the CLI against real
``tandem serve`` subprocesses on the tiny model (a few seconds of load); the results JSON
follows its schema and the plots are PNG files."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

from tandem.bench import serve as serve_bench
from tandem.bench.launcher import TandemServer
from tandem.bench.server_cpu import fit_per_step_and_token

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

NUM = {"type": "number"}
NUM_OR_NULL = {"type": ["number", "null"]}
STATS = {"type": "object", "required": ["p50", "p90", "p99", "mean", "count"],
         "properties": {k: NUM_OR_NULL for k in ("p50", "p90", "p99", "mean")}}
RECORD = {
    "type": "object",
    "required": ["index", "kind", "scheduled_s", "sent_s", "prompt_tokens", "output_tokens", "expected_output_tokens",
                 "chunks", "ok", "status", "error", "ttft_s", "tpot_s", "e2e_s", "itl_s"],
    "properties": {"index": {"type": "integer"}, "ok": {"type": "boolean"}, "error": {"type": ["string", "null"]},
                   "ttft_s": NUM_OR_NULL, "tpot_s": NUM_OR_NULL, "e2e_s": NUM_OR_NULL,
                   "itl_s": {"type": "array", "items": NUM}, "output_tokens": {"type": "integer"}},
}
SUMMARY = {
    "type": "object",
    "required": ["requests", "completed", "failed", "errors", "duration_s", "ttft_ms", "tpot_ms", "itl_ms",
                 "e2e_ms", "throughput", "attainment", "by_kind"],
    "properties": {"ttft_ms": STATS, "tpot_ms": STATS, "itl_ms": STATS, "e2e_ms": STATS,
                   "errors": {"type": "object", "additionalProperties": {"type": "integer"}},
                   "throughput": {"type": "object", "required": ["requests_per_s", "output_tokens_per_s",
                                                                 "good_requests_per_s"]},
                   "attainment": {"type": "object", "required": ["both", "ttft", "tpot"]}},
}
RESULTS = {
    "type": "object",
    "required": ["schema", "label", "meta", "config", "slo", "runs", "goodput", "plots"],
    "properties": {
        "schema": {"const": "tandem.bench.serve/v1"},
        "meta": {"type": "object", "required": ["date", "command", "versions", "machine", "server"],
                 "properties": {"machine": {"type": "object", "required": ["platform", "cpu_count"]},
                                "server": {"type": "object", "required": ["url", "model"]}}},
        "slo": {"type": "object", "required": ["ttft_ms", "tpot_ms", "attainment"]},
        "runs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["rate", "arrival", "summary", "requests"],
            "properties": {"rate": NUM_OR_NULL, "summary": SUMMARY, "requests": {"type": "array", "items": RECORD}}}},
        "goodput": {"type": "object", "required": ["rps", "interpolated_rps", "bounded", "below_sweep", "target",
                                                 "points"]},
        "plots": {"type": "object", "required": ["latency_cdf", "attainment", "goodput"]},
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(str(tiny_model_dir), served_model_name="tiny", startup_timeout_s=180) as srv:
        yield srv


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli.main", "bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _assert_png(path: str | Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG and len(data) > 1000, path


def _prompt_tokens_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_prompt_tokens_total"))


def test_bench_serve_writes_every_record_a_summary_and_plots(server, tiny_model_dir, tmp_path):
    out = tmp_path / "serve"
    served_before = _prompt_tokens_served(server.url)
    workload = ("--url", server.url, "--tokenizer", str(tiny_model_dir), "--input-len", "uniform:8-32",
                "--output-len", "8", "--num-prompts", "8", "--rates", "8,inf")
    proc = _cli("serve", *workload, "--slo-ttft-ms", "3000",
                "--slo-tpot-ms", "500", "--cooldown", "0.2", "--request-timeout", "60", "--max-duration", "90",
                "--meta", "note=ci", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "goodput" in proc.stdout and "sent 8/8" in proc.stderr  # the summary and the progress line
    data = json.loads((out / "results.json").read_text())
    jsonschema.validate(data, RESULTS)
    assert [run["rate"] for run in data["runs"]] == [8.0, None]  # None: all at once (JSON has no inf)
    first = data["runs"][0]
    assert first["summary"]["requests"] == 8 and len(first["requests"]) == 8
    assert first["summary"]["completed"] == 8, first["summary"]["errors"]
    for rec in first["requests"]:
        assert rec["prompt_tokens"] == rec["expected_prompt_tokens"]  # token ids in, exact lengths
        assert rec["output_tokens"] == 8 and rec["ttft_s"] > 0 and rec["e2e_s"] >= rec["ttft_s"]
    assert data["meta"]["server"]["pools"] == {"prefill": 1, "decode": 1}  # read from the server
    assert data["meta"]["server"]["note"] == "ci"
    assert data["config"]["tokenizer"] == str(tiny_model_dir)
    for png in data["plots"].values():
        _assert_png(png)
    # the warm-up (4 requests by default, the longest prompt first) reached the server: exactly its prompt
    # tokens on top of the sweep's (lengths follow the seed alone; that the recorded salt replays the
    # token ids is checked in tests/unit/test_bench_workload.py)
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    replay = serve_bench.plan(parser.parse_args([*workload, "--prompt-salt", str(data["config"]["prompt_salt"])]))
    assert [rec["prompt_tokens"] for rec in first["requests"]] == [r.prompt_len for r in replay.requests(0)]
    swept = sum(rec["prompt_tokens"] for run in data["runs"] for rec in run["requests"])
    warm = _prompt_tokens_served(server.url) - served_before - swept
    assert data["config"]["warmup"] == 4 and warm == sum(r.prompt_len for r in replay.warmup(4))


def test_bench_serve_reports_a_goodput_below_the_rates_it_swept(server, tiny_model_dir, tmp_path):
    # an SLO no server meets (a first token within a microsecond): the goodput lies below the
    # lowest rate, which the summary, the results and the plots say, rather than a measured 0
    out = tmp_path / "below"
    proc = _cli("serve", "--url", server.url, "--tokenizer", str(tiny_model_dir), "--input-len", "16",
                "--output-len", "4", "--num-prompts", "4", "--rates", "2,4", "--slo-ttft-ms", "0.001",
                "--warmup", "1", "--request-timeout", "60", "--max-duration", "90", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "goodput: below 2 req/s (the lowest rate swept missed the SLO" in proc.stdout
    data = json.loads((out / "results.json").read_text())
    jsonschema.validate(data, RESULTS)
    assert data["goodput"]["below_sweep"] and data["goodput"]["rps"] == 0.0
    assert all(run["summary"]["completed"] == 4 for run in data["runs"])  # served, just too slowly
    _assert_png(data["plots"]["goodput"])


def test_bench_compare_runs_both_modes_and_another_server(server, tiny_model_dir, tmp_path):
    out = tmp_path / "compare"
    proc = _cli("compare", "--model", str(tiny_model_dir), "--input-len", "16", "--output-len", "8",
                "--num-prompts", "6", "--rates", "4", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "500",
                "--other-url", server.url, "--other-label", "running", "--warmup", "1",
                "--request-timeout", "60", "--max-duration", "90", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "compare.json").read_text())
    assert summary["schema"] == "tandem.bench.compare/v1"
    assert list(summary["systems"]) == ["disaggregated", "colocated", "running"]
    assert summary["systems"]["colocated"]["server"]["pools"] == {"both": 2}
    assert summary["ratios"]["baseline"] == "colocated"
    assert "goodput (req/s)" in proc.stdout and "p90 TPOT" in proc.stdout
    _assert_png(summary["plot"])
    for label in summary["systems"]:
        data = json.loads((out / f"{label}-results.json").read_text())
        jsonschema.validate(data, RESULTS)
        assert data["runs"][0]["summary"]["completed"] == 6
        # one request sequence for every system
        assert [r["expected_prompt_tokens"] for r in data["runs"][0]["requests"]] == [16] * 6
    # the started servers are gone: their ports no longer answer
    for label in ("disaggregated", "colocated"):
        url = json.loads((out / f"{label}-results.json").read_text())["meta"]["server"]["url"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)


def test_plan_validate_measures_a_started_server_and_its_cpu(tiny_model_dir, tmp_path):
    from tandem.planner import profile as profile_mod
    from tandem.planner.perf_model import attention_pairs

    pts = {"prefill": [{"tokens": n, "seqs": 1, "pairs": attention_pairs(n), "seconds": 0.005 + 1e-5 * n}
                       for n in (16, 64, 256)],
           "decode": [{"batch": b, "context": c, "seconds": 0.005 + 1e-4 * b} for b, c in ((1, 32), (8, 64), (16, 32))],
           "mixed": [], "transfer": [{"bytes": b, "seconds": 1e-3 + b / 1e9} for b in (2**16, 2**20)]}
    prof = profile_mod.fit({
        "schema": profile_mod.SCHEMA, "hardware": {"cpu": "test CPU", "cores": 2, "device": "cpu"},
        "model": {"path": str(tiny_model_dir)},
        "worker": {"threads_per_worker": 1, "prefill_nice": 0,
                   "weight_layouts": {"prefill": "plain", "decode": "blocked", "colocated": "plain"}},
        "engine": {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 16, "num_blocks": 1024,
                   "kv_bytes_per_token": 1024}, "points": pts})
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "tandem.cli.main", "plan", "--profile", str(path),
                           "--mixes", "colocatedx1,1P+1D-conditional", "--input-len", "uniform:8-24",
                           "--local-prefill-threshold", "16", "--output-len", "8",
                           "--num-prompts", "6", "--rates", "4", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "500",
                           "--repeats", "2", "--validate", "--no-plots", "--out-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    row, disagg = json.loads((out / "plan.json").read_text())["validation"]["rows"]
    # each mix's measured goodput is its measured results' (how high it is depends on this machine)
    # conditional: prompts under 16 tokens prefill on the decode worker, the rest on the prefill worker
    assert row["mix"] == "colocated×1" and disagg["mix"] == "1P+1D-conditional", (row, disagg)
    for r in (row, disagg):
        results = json.loads((out / f"measured-{r['mix']}-results.json").read_text())
        assert r["measured_rps"] == results["goodput"]["interpolated_rps"] >= 0, r
    # the served step factors, from each worker role's engine-step CPU and steps: a
    # colocated worker's scale both, a prefill and a decode worker give one each
    cpu, steps = row["engine_cpu_s_and_steps"]["both"]
    assert cpu > 0 and steps >= 8 and set(row["step_factors"]) == {"prefill", "decode"}
    assert set(disagg["engine_cpu_s_and_steps"]) == {"prefill", "decode"}
    assert all(cpu > 0 and steps > 0 for cpu, steps in disagg["engine_cpu_s_and_steps"].values())
    assert all(f > 0 for f in [*row["step_factors"].values(), *disagg["step_factors"].values()])
    assert set(disagg["step_factors"]) == {"prefill", "decode"}
    # the server's CPU at rest, the request path's CPU, per token what the plan's cost per
    # engine step leaves of it, and other processes' CPU are each measured (their sizes are
    # this machine's load): numbers, the cores and the per-token cost never negative
    for key in ("idle_cores", "request_path_cpu_s", "request_path_ms_per_token", "background_cores"):
        assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row[key])
    assert row["idle_cores"] >= 0 and row["background_cores"] >= 0 and row["request_path_ms_per_token"] >= 0
    assert [r["rate"] for r in row["predicted_runs"]] == [4.0] and "ttft_ms" in row["predicted_runs"][0]["summary"]
    assert "idle" in proc.stdout and "colocated×1" in proc.stdout
    # each mix served on the layouts its steps were profiled on
    served = [line for line in proc.stdout.splitlines() if line.startswith("measuring ")]
    assert len(served) == 2 and all("--cpu-weight-layout=plain --prefill-weight-layout=plain "
                                    "--decode-weight-layout=blocked" in line for line in served), served
    assert "--mode colocated" in served[0]
    assert "--mode conditional" in served[1] and "--local-prefill-threshold 16 --prefill-saturation-s 1" in served[1]
    # both simulated sequences were measured, pooled per rate as the simulation pools them
    measured = json.loads((out / "measured-colocated×1-results.json").read_text())
    (run,) = measured["runs"]
    assert len(run["requests"]) == 12 and run["summary"]["completed"] == 12 and run["sweeps"] == 2
    assert len(set(measured["config"]["seeds"])) == 2


def test_request_path_fits_a_started_servers_cpu_per_step_and_token(tiny_model_dir, tmp_path):
    out = tmp_path / "path.json"
    proc = subprocess.run([sys.executable, "-m", "tandem.cli.main", "bench", "request-path",
                           "--model", str(tiny_model_dir), "--streams", "1,4", "--rounds", "1",
                           "--output-len", "8", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    one, four = data["batches"]
    assert (one["streams"], one["tokens"], four["tokens"]) == (1, 8, 32)
    # one request's 7 later tokens take 7 decode steps; 4 together take at least as many
    assert one["steps"] >= 8 and four["steps"] >= 8  # plus the prefill step(s)
    # what each batch's request path cost, and the server's CPU at rest, are this machine's
    # measurements: numbers, the cores at rest and the batches' lengths never negative
    assert all(isinstance(b["path_cpu_s"], float) and math.isfinite(b["path_cpu_s"]) and b["seconds"] > 0
               for b in (one, four)), data["batches"]
    assert isinstance(data["idle_cores"], float) and math.isfinite(data["idle_cores"]) and data["idle_cores"] >= 0
    # the per-step / per-token split is the fit of the batches, never negative
    fitted = fit_per_step_and_token([(b["steps"], b["tokens"], b["path_cpu_s"]) for b in (one, four)])
    assert (data["per_step_s"], data["per_token_s"]) == pytest.approx(fitted)
    assert data["per_step_s"] >= 0 and data["per_token_s"] >= 0
    assert (f"--server-idle-cores {data['idle_cores']:.2f} --frontend-ms-per-step {1e3 * data['per_step_s']:.2f} "
            f"--frontend-ms-per-token {1e3 * data['per_token_s']:.2f}") in proc.stdout
