"""The device check's own plumbing: its dry run on CPU, its verdicts and its transfer slot.

The dry run goes through a child Python in which ray, fastapi, pydantic, uvicorn
and gguf cannot be imported (as on the GPU machine it is written for), so the
check's import graph is checked where it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from tandem.gpucheck import report, transfer_checks
from tandem.gpucheck.report import Result, Status

ROOT = Path(__file__).resolve().parents[2]
MISSING_ON_THE_GPU_MACHINE = ("ray", "fastapi", "pydantic", "uvicorn", "gguf")

_RUN_WITHOUT = textwrap.dedent("""
    import importlib.abc, runpy, sys
    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {missing!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Missing())
    sys.argv = ["gpucheck", *{args!r}]
    runpy.run_module("tandem.gpucheck", run_name="__main__")
""")


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = _RUN_WITHOUT.format(missing=set(MISSING_ON_THE_GPU_MACHINE), args=list(args))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "services"), **(env or {})})


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("triton") is None,
                    reason="the dry run interprets the Triton kernels")
def test_dry_run_runs_every_section_on_cpu_and_prints_one_table():
    out = _check("--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    table = out.stdout
    assert table.startswith("tandem gpu-check (dry run, CPU): all passed")
    rows = {line.split(" | ")[0].strip(): line.split(" | ")[1].strip()
            for line in table.splitlines()[3:]}
    for section in ("device", "floor: HBM bandwidth", "floor: matmul peak",
                    "engine fp32 vs transformers", "engine fp16 vs transformers",
                    "cuda graphs vs eager tokens", "decode b1 vs HBM floor",
                    "kv transfer: one device", "stream ordering probe"):
        assert section in rows, f"{section!r} missing from\n{table}"
    assert rows["engine fp32 vs transformers"] == "PASS"
    assert rows["cuda graphs vs eager tokens"] == "PASS"
    assert rows["sampling masks"] == rows["seeded sampling fp32"] == "DRY"  # ran, agreed
    assert rows["kv transfer: one device"] == "DRY"  # both ends moved the cache, intact
    assert rows["kv transfer: two devices"] == "SKIP"
    assert any(name.startswith("kernel float32") and status == "PASS"
               for name, status in rows.items())
    assert any(name.startswith("prefill") for name in rows)
    assert ">= 70%" in table and ">= 50%" in table  # the targets are printed


def test_without_cuda_it_fails_at_once():
    out = _check(env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == report.NO_DEVICE
    assert "no CUDA device" in out.stdout


def test_verdicts():
    ok, fail = Result("a", Status.PASS, ""), Result("b", Status.FAIL, "")
    miss, skip = Result("c", Status.MISS, ""), Result("d", Status.SKIP, "")
    assert report.exit_code([ok, skip]) == report.OK
    assert report.exit_code([ok, fail]) == report.FAILED
    assert report.exit_code([ok, miss]) == report.FAILED  # a missed target fails the check
    assert report.exit_code([skip, skip]) == report.NOTHING_PASSED  # all skipped never passes
    assert report.exit_code([Result("e", Status.DRY, "")]) == report.NOTHING_PASSED


def test_transfer_rows_fail_on_an_error_or_a_corrupted_block(monkeypatch):
    from tandem.transfer import pair_check

    ctx = types.SimpleNamespace(dry_run=False, device="cuda:0")
    broken = pair_check.PairCheckResult("ipc", 0, [], False, "rank 1: TimeoutError: no header")
    monkeypatch.setattr(pair_check, "check_pair", lambda *a, **k: broken)
    [row] = transfer_checks.check_same_device(ctx)
    assert row.status == Status.FAIL and "no header" in row.result
    corrupted = pair_check.PairCheckResult("ipc", 1 << 20, [0.001], False)
    monkeypatch.setattr(pair_check, "check_pair", lambda *a, **k: corrupted)
    [row] = transfer_checks.check_same_device(ctx)
    assert row.status == Status.FAIL and "corrupted" in row.result
    intact = pair_check.PairCheckResult("ipc", 1 << 20, [0.001], True)
    monkeypatch.setattr(pair_check, "check_pair", lambda *a, **k: intact)
    [row] = transfer_checks.check_same_device(ctx)
    assert row.status == Status.PASS and "GB/s" in row.figure

def test_table_lines_up():
    text = report.table([Result("x", Status.PASS, "ok", "1 ms", ">= 1")], header="h")
    lines = text.splitlines()
    assert lines[0] == "h" and lines[1].startswith("section | status")
    assert lines[3].split(" | ")[:2] == ["x      ", "PASS  "]
