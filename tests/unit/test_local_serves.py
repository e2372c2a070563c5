"""How `tandem drain` and `tandem scale` find a `tandem serve` on this machine: the records
the serves keep (private, gone with their serve), the lookup (the only live one, one picked
by deployment or port, several or none) and the Ray token each join needs. The real
serve and CLI round trip is in tests/integration/test_local_drain.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import subprocess
import sys

import pytest

from tandem.cli import control as cli_control
from tandem.cli.main import build_parser
from tandem.cluster import local_serves
from tandem.cluster.local_serves import LocalServe


@pytest.fixture
def runtime(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "tandem"


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _serve(port: int, deployment: str | None = None, pid: int | None = None, **kw) -> LocalServe:
    return LocalServe(pid=os.getpid() if pid is None else pid, ray_address=f"127.0.0.1:{port + 1}",
                      control_name=deployment or f"gateway-{port}", deployment=deployment,
                      host="127.0.0.1", port=port, **kw)


def _write(runtime, serve: LocalServe, name: str | None = None) -> None:
    runtime.mkdir(mode=0o700, exist_ok=True)
    (runtime / (name or f"serve-{serve.pid}-{serve.port}.json")).write_text(
        json.dumps(dataclasses.asdict(serve)))


def test_a_record_is_private_and_lives_as_long_as_its_serve(runtime):
    serve = _serve(8000)
    with local_serves.recorded(serve) as path:
        assert path.parent == runtime
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        assert local_serves.live() == [serve]
        assert local_serves.find() == serve
    assert not path.exists()
    assert local_serves.live() == [] and local_serves.find() is None


def test_a_record_that_cannot_be_written_does_not_stop_the_serve(runtime, caplog):
    runtime.parent.joinpath("tandem").write_text("a file where the folder goes")
    with local_serves.recorded(_serve(8000)) as path:
        assert path is None
    assert "cannot record" in caplog.text


def test_without_xdg_runtime_dir_the_records_go_to_a_private_folder_of_the_cache(
        monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert local_serves.runtime_dir() == tmp_path / f"run-{os.getuid()}"


def test_records_of_ended_processes_and_other_machines_are_skipped(runtime, dead_pid):
    alive = _serve(8000)
    _write(runtime, alive)
    _write(runtime, _serve(8001, pid=dead_pid))
    _write(runtime, _serve(8002, hostname="another-machine"))
    (runtime / "serve-garbled.json").write_text("{not json")
    (runtime / "serve-old.json").write_text(json.dumps({"pid": os.getpid(), "port": 1}))
    assert local_serves.live() == [alive]
    assert not (runtime / f"serve-{dead_pid}-8001.json").exists()  # removed
    assert local_serves.find() == alive


def test_one_of_several_is_picked_by_deployment_or_port(runtime):
    a, b, c = _serve(8000), _serve(8001, "prod"), _serve(9000, "prod")
    for s in (a, b, c):
        _write(runtime, s)
    assert local_serves.live() == [a, b, c]
    with pytest.raises(ValueError, match=r"^3 tandem serves run on this machine \(port 8000, "
                       r"gateway gateway-8000, pid \d+; port 8001, deployment prod.*--port PORT"):
        local_serves.find()
    assert local_serves.find(port=8000) == a
    assert local_serves.find(deployment="gateway-8000") == a  # its gateway name
    assert local_serves.find(deployment="prod", port=9000) == c
    with pytest.raises(ValueError, match="^2 tandem serves .*port 8001.*port 9000"):
        local_serves.find(deployment="prod")
    with pytest.raises(ValueError, match=r"no tandem serve on this machine has --deployment "
                       r"prod and --port 8000 \(running: port 8000.*--ray-address"):
        local_serves.find(deployment="prod", port=8000)


def test_none_running_here_leaves_it_to_ray_unless_a_port_was_named(runtime):
    assert local_serves.find() is None
    assert local_serves.find(deployment="prod") is None  # a cluster elsewhere may have it
    with pytest.raises(ValueError, match="no tandem serve runs on this machine"):
        local_serves.find(port=8000)


def test_the_ray_token_comes_from_the_file_the_serve_read_or_this_environment(runtime, monkeypatch):
    assert _serve(8000).ray_env() == {}
    by_file = _serve(8000, token_auth=True, token_path="/t/token")
    assert by_file.ray_env() == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/t/token",
                                 "RAY_AUTH_TOKEN": None}
    by_env = _serve(8000, token_auth=True)
    with pytest.raises(ValueError, match=r"token in \$RAY_AUTH_TOKEN: set it for this command"):
        by_env.ray_env()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    assert by_env.ray_env() == {"RAY_AUTH_MODE": "token"}


def test_a_serve_records_where_its_token_comes_from(monkeypatch, tmp_path):
    import ray._private.authentication.authentication_utils as auth

    monkeypatch.setattr(auth, "is_token_auth_enabled", lambda: False)
    assert local_serves.ray_token_source() == (False, None)
    monkeypatch.setattr(auth, "is_token_auth_enabled", lambda: True)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert local_serves.ray_token_source() == (True, str(tmp_path / ".ray" / "auth_token"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "tok")
    assert local_serves.ray_token_source() == (True, str(tmp_path / "tok"))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")  # it wins over any file
    assert local_serves.ray_token_source() == (True, None)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["drain", "decode-1", *argv])


def test_drain_and_scale_join_the_local_serve_by_default(runtime):
    assert _args().ray_address is None
    assert build_parser().parse_args(["scale", "--decode", "1"]).ray_address is None
    runtime_, name = cli_control._join(_args())
    assert (runtime_.address, name) == ("auto", None)  # nothing here: Ray's own lookup
    _write(runtime, _serve(8000, token_auth=True, token_path="/t/token"))
    _write(runtime, _serve(8001, "prod"))
    with pytest.raises(ValueError, match="2 tandem serves"):
        cli_control._join(_args())
    runtime_, name = cli_control._join(_args("--port", "8000"))
    assert (runtime_.address, name) == ("127.0.0.1:8001", "gateway-8000")
    assert runtime_.env["RAY_AUTH_TOKEN_PATH"] == "/t/token"
    runtime_, name = cli_control._join(_args("--deployment", "prod"))
    assert (runtime_.address, name, runtime_.env) == ("127.0.0.1:8002", "prod", {})
    runtime_, name = cli_control._join(_args("--ray-address", "10.0.0.1:6379", "--deployment", "x"))
    assert (runtime_.address, name) == ("10.0.0.1:6379", "x")  # named by hand: as before
    with pytest.raises(ValueError, match="--port picks a tandem serve on this machine"):
        cli_control._join(_args("--ray-address", "10.0.0.1:6379", "--port", "8000"))
