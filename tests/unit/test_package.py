"""What installing tandem puts into site-packages: one top-level package, ``tandem``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel ``pip install .`` would install, built from a copy of the source tree."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "services", src / "services",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("tandem-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_tandem_and_nothing_named_services(wheel):
    names = wheel.namelist()
    info = next(n for n in names if n.endswith(".dist-info/RECORD")).rsplit("/", 1)[0]
    top = {n.split("/")[0] for n in names} - {info}
    assert top == {"tandem"}, top
    if f"{info}/top_level.txt" in names:
        assert wheel.read(f"{info}/top_level.txt").decode().split() == ["tandem"]
    record = wheel.read(f"{info}/RECORD").decode()
    assert not any(line.startswith("services") for line in record.splitlines())
    assert "tandem = tandem.cli.main:main" in wheel.read(f"{info}/entry_points.txt").decode()


def test_the_wheel_carries_the_kernel_sources_and_no_documents(wheel):
    names = set(wheel.namelist())
    assert "tandem/engine/kernels/csrc/kernels.h" in names  # compiled on the serving machine
    assert "tandem/protocol/gen/tandem/v1/kv_transfer_pb2.py" in names
    assert not [n for n in names if n.endswith(".md")]  # documents stay in the repository
