"""The local cluster (deploy/compose.yaml) and the Prometheus scrape configurations.

No Docker engine here: the compose file is checked structurally (services,
commands, private ports, hardening, mounted files exist); the Prometheus
configurations with promtool where it is installed (Debian package prometheus).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
RAY_PORTS = {"6379", "10001", "8265"}
TANDEM_SERVICES = ("ray-head", "prefill", "decode", "gateway")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def command(svc: dict) -> list[str]:
    cmd = svc["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def test_services(compose):
    assert set(compose["services"]) == {*TANDEM_SERVICES, "prometheus", "grafana"}


def test_images_are_pinned(compose):
    for name, svc in compose["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: {image}"
    images = {compose["services"][n]["image"] for n in TANDEM_SERVICES}
    assert images == {"tandem:0.1.0-cpu"}
    build = compose["services"]["ray-head"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()


def test_ports_are_published_on_loopback_only_and_never_rays(compose):
    published = {}
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            host_ip, host_port, container_port = str(port).split(":")
            assert host_ip == "127.0.0.1", f"{name}: {port}"
            assert container_port not in RAY_PORTS, f"{name}: {port}"
            published[name] = int(container_port)
    assert published == {"gateway": 8000, "prometheus": 9090, "grafana": 3000}


def test_tandem_containers_are_hardened(compose):
    for name in TANDEM_SERVICES:
        svc = compose["services"][name]
        assert svc["user"] == "1000:1000", name
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert any(t.startswith("/tmp") for t in svc["tmpfs"]), name
        assert not svc.get("privileged"), name
    for name in ("prometheus", "grafana"):
        svc = compose["services"][name]
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"] and svc["user"].split(":")[0] != "0"


def test_ray_nodes_advertise_the_pool_resources(compose):
    head = command(compose["services"]["ray-head"])
    assert compose["services"]["ray-head"]["entrypoint"] == ["ray"]
    assert head[:2] == ["start", "--head"] and "--ray-client-server-port=10001" in head
    for pool in ("prefill", "decode"):
        svc = compose["services"][pool]
        assert svc["entrypoint"] == ["ray"]
        args = command(svc)
        (res,) = [a for a in args if a.startswith("--resources=")]
        assert json.loads(res.split("=", 1)[1]) == {f"tandem_{pool}": 1}
        assert "--address=ray-head:6379" in args
        # the worker nodes share one host: each advertises a set count of Ray CPUs (its
        # worker's torch threads), never Ray's count of the host's cores
        assert f"--num-cpus=${{TANDEM_{pool.upper()}_CPUS:-1}}" in args
        assert svc["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_gateway_joins_the_cluster_with_matching_worker_counts(compose):
    svc = compose["services"]["gateway"]
    args = command(svc)
    assert args[0] == "serve"
    opt = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert opt["--host"] == "0.0.0.0" and opt["--port"] == "8000"
    # a Ray node of its own, then tandem serve as a full driver (not Ray client)
    assert opt["--ray-address"] == "ray-head:6379"
    bash, dash_c, script, argv0 = svc["entrypoint"]
    assert (bash, dash_c, argv0) == ("/bin/bash", "-c", "tandem-gateway")
    assert "ray start --address=ray-head:6379 --num-cpus=0 --num-gpus=0" in script
    assert script.rstrip().endswith('exec tandem "$$@"')  # "$$" is compose's escape for "$"
    assert opt["--prefill-resource"] == "tandem_prefill=1" and opt["--decode-resource"] == "tandem_decode=1"
    # the worker counts and the pools' replicas come from the same variables
    assert opt["--prefill-workers"] == compose["services"]["prefill"]["deploy"]["replicas"]
    assert opt["--decode-workers"] == compose["services"]["decode"]["deploy"]["replicas"]
    # an API key is required (compose stops with the message when it is unset or empty)
    assert svc["environment"]["TANDEM_API_KEY"].startswith("${TANDEM_API_KEY:?")
    assert "--allow-unauthenticated" not in args
    assert "/health" in " ".join(svc["healthcheck"]["test"])


def test_mounted_files_exist(compose):
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {vol}"
    overlay = yaml.safe_load((DEPLOY / "compose.models.yaml").read_text())
    assert set(overlay["services"]) == {"gateway", "prefill", "decode"}


def test_grafana_is_provisioned_from_deploy_grafana(compose):
    vols = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    dashboards_at = next(dst for dst, src in vols.items() if src == "./grafana")
    provisioning = DEPLOY / vols["/etc/grafana/provisioning"]
    providers = [p for f in (provisioning / "dashboards").glob("*.y*ml")
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert any(p["options"]["path"] == dashboards_at for p in providers)
    sources = [d for f in (provisioning / "datasources").glob("*.y*ml")
               for d in yaml.safe_load(f.read_text())["datasources"]]
    assert any(d["type"] == "prometheus" and d["url"] == "http://prometheus:9090" for d in sources)


def _scrape_targets(path: Path) -> dict[str, list[str]]:
    cfg = yaml.safe_load(path.read_text())
    return {j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
            for j in cfg["scrape_configs"]}


def test_local_scrape_config_targets_the_local_gateway():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "tandem" and job["metrics_path"] == "/metrics"
    assert _scrape_targets(DEPLOY / "prometheus" / "prometheus.yml") == {"tandem": ["127.0.0.1:8000"]}
    compose_targets = _scrape_targets(DEPLOY / "compose" / "prometheus.yml")
    assert compose_targets["tandem"] == ["gateway:8000"]


@pytest.mark.skipif(shutil.which("promtool") is None and os.environ.get("REQUIRE_PROMTOOL") != "1",
                    reason="promtool is not installed (Debian package prometheus)")
@pytest.mark.parametrize("config", ["prometheus/prometheus.yml", "compose/prometheus.yml"])
def test_promtool_accepts_the_scrape_configs(config):
    assert shutil.which("promtool"), "promtool is not installed (Debian package prometheus)"
    proc = subprocess.run(["promtool", "check", "config", str(DEPLOY / config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ray_requires_its_token_everywhere_and_keeps_the_dashboard_on_loopback(compose):
    for name in TANDEM_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN"].startswith("${TANDEM_RAY_TOKEN:?"), name  # required, no default
    head = command(compose["services"]["ray-head"])
    assert "--dashboard-host=127.0.0.1" in head
    assert not any("0.0.0.0" in a for name in TANDEM_SERVICES if name != "gateway"
                   for a in command(compose["services"][name]))
