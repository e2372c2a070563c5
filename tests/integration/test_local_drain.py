"""`tandem drain` and `tandem scale` find a local `tandem serve` with no address flags.

The Ray of a local `tandem serve` listens on loopback only and wants Ray's token, where
Ray's own `auto` lookup does not reach; the serve records itself (tandem.cluster.local_serves)
and the commands join it from there: a real `tandem serve` (colocated, two workers, the
tiny checkpoint) and the real commands, each a process of its own. With a second serve
recorded on the machine the command asks which one, and `--port` picks it. The record goes
with the serve.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tandem.cluster.local_serves import LocalServe
from tests.integration.test_listeners import ROOT, Served

pytest.importorskip("psutil")
COMMAND_TIMEOUT_S = 180  # a loaded 2-core machine: Python, Ray's import, joining the cluster


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def test_drain_and_scale_reach_the_local_serve_without_an_address(checkpoint, tmp_path,
                                                                   monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))  # this test's serves only
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    served = Served(tmp_path, "--model", checkpoint, "--mode", "colocated",
                    "--prefill-workers", "0", "--decode-workers", "2")
    try:
        served.wait_ready(f"http://127.0.0.1:{served.port}")
        record = run / "tandem" / f"serve-{served.proc.pid}.json"
        assert json.loads(record.read_text())["port"] == served.port

        drain = _tandem("drain", "decode-1", "--timeout", "0")
        assert drain.returncode == 0, drain.stderr[-3000:]
        outcome = json.loads(drain.stdout)
        assert set(outcome) == {"decode-1"} and "error" not in outcome["decode-1"], outcome
        assert outcome["decode-1"]["redriven"] == 0  # nothing was running on it

        other = LocalServe(pid=os.getpid(), ray_address="127.0.0.1:1", control_name="other",
                           deployment="other", host="127.0.0.1", port=served.port + 1)
        (run / "tandem" / f"serve-{os.getpid()}.json").write_text(
            json.dumps(dataclasses.asdict(other)))
        ambiguous = _tandem("scale", "--decode", "1")
        assert ambiguous.returncode == 2, ambiguous.stderr[-3000:]
        assert "2 tandem serves run on this machine" in ambiguous.stderr
        scale = _tandem("scale", "--decode", "1", "--port", str(served.port))
        assert scale.returncode == 0, scale.stderr[-3000:]
        assert json.loads(scale.stdout) == {"decode": {"workers": 1, "added": [], "drained": []}}
    finally:
        served.stop()
    assert not record.exists()
