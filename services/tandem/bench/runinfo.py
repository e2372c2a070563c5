"""What makes a benchmark run self-describing: machine, versions, date, command line."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tandem.engine.kernels import cpu_features
from tandem.worker.threads import usable_cores

PACKAGES = ("tandem", "torch", "ray", "httpx", "numpy", "matplotlib")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def cpu_description(cpuinfo: str) -> str | None:
    """The first processor of /proc/cpuinfo's text as figures need it named: model name,
    family and model (a cloud CPU's name alone is often just "AMD EPYC") and its widest
    vector instruction set, e.g. "AMD EPYC (family 25 model 1, AVX2)"; None without a name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block ends
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return None
    family = f"family {fields['cpu family']} model {fields['model']}, " if "cpu family" in fields \
        and "model" in fields else ""
    return f"{name} ({family}{cpu_features.vector_isa(frozenset(fields.get('flags', '').split()))})"


def _cpu_model() -> str | None:
    try:
        described = cpu_description(Path("/proc/cpuinfo").read_text())
    except OSError:
        described = None
    return described or platform.processor() or None


def machine() -> dict:
    """Platform, CPU model and count (the cores this process may use: its affinity, capped
    by a cgroup CPU quota), memory, load."""
    try:
        usable = usable_cores()
    except (AttributeError, OSError):
        usable = None
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gb = None
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(), "cpus_usable": usable,
            "memory_gb": round(mem_gb, 1) if mem_gb else None, "load_avg_at_start": load,
            "hostname": platform.node()}


def describe() -> dict:
    """Date (UTC), command line, Python and package versions, git commit, machine."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "python": platform.python_version(),
            "versions": {name: _version(name) for name in PACKAGES},
            "git_commit": _git_commit(), "machine": machine()}


def machine_line() -> str:
    """One line for a benchmark's printed figures: CPU model, usable cores, load average now."""
    m = machine()
    load = "/".join(f"{x:.2f}" for x in m["load_avg_at_start"]) if m["load_avg_at_start"] else "?"
    hidden = ",".join(sorted(cpu_features.hidden_flags()))
    return (f"machine: {m['cpu'] or m['machine']}, {m['cpus_usable'] or m['cpu_count']} usable cores, "
            f"load average {load} (1/5/15 min)"
            + (f", run as without CPU flags {hidden} (TANDEM_CPU_FLAGS_OFF)" if hidden else ""))
