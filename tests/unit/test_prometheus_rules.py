"""Prometheus's own checks of deploy/prometheus/ with promtool (services/ARCHITECTURE.md, "Metrics").

`promtool check rules` and `promtool test rules` on the alert and recording rules,
`promtool check config` on the local scrape configuration (its rule files included), and
`promtool check metrics` (its naming lint) on the exposition text of every metric family
the code defines.
promtool comes from Debian's `prometheus` package, which .ci/run installs; the tests
skip when it is absent, and fail instead when REQUIRE_PROMTOOL=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from tandem.common.metrics import cluster_families, gateway_metrics, worker_metrics

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")



@pytest.fixture(autouse=True)
def _promtool_present():
    """Skip without promtool; fail instead where REQUIRE_PROMTOOL=1 (.ci/run sets it)."""
    if PROMTOOL is None:
        reason = "promtool not installed: `apt-get install -y prometheus` (Debian) provides it"
        if os.environ.get("REQUIRE_PROMTOOL") == "1":
            pytest.fail(f"REQUIRE_PROMTOOL=1 but {reason}")
        pytest.skip(reason)


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=60)


def rule_files() -> list[Path]:
    return sorted([*(PROM / "rules").glob("*.yml"), *(PROM / "rules").glob("*.yaml")])


def test_check_rules():
    files = rule_files()
    assert files, "deploy/prometheus/rules/ has rule files"
    proc = promtool("check", "rules", *map(str, files))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rule_unit_tests():
    tests = sorted((PROM / "tests").glob("*.test.y*ml"))
    assert tests, "deploy/prometheus/tests/ has promtool unit tests"
    proc = promtool("test", "rules", *map(str, tests))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every alert the rules define is exercised by a unit test.
    alerts = {r["alert"] for f in rule_files() for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tested = {case["alertname"] for f in tests for t in yaml.safe_load(f.read_text())["tests"]
              for case in t.get("alert_rule_test", [])}
    firing = {case["alertname"] for f in tests for t in yaml.safe_load(f.read_text())["tests"]
              for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert alerts <= tested, f"alerts without a unit test: {sorted(alerts - tested)}"
    assert alerts <= firing, f"alerts never tested firing: {sorted(alerts - firing)}"


def test_check_local_config():
    """The scrape config for a local `tandem serve`, with its rule files resolved and checked."""
    proc = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout, proc.stdout


class _Static:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def test_check_metrics_lint():
    """Every family the code defines passes promtool's metric naming lint."""
    gateway = CollectorRegistry()
    m = gateway_metrics(gateway)
    m.requests.labels(finish_reason="stop", status="200").inc()
    _, worker = worker_metrics("decode", "d0")
    cluster = CollectorRegistry()
    cluster.register(_Static(cluster_families({"remote": 3, "local_short_prompt": 1}, 1, 0,
                                              {"prefill": 1, "decode": 1})))
    text = "".join(generate_latest(r).decode() for r in (gateway, worker, cluster))
    proc = promtool("check", "metrics", stdin=text)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), \
        proc.stdout + proc.stderr
