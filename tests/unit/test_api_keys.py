"""API keys of `tandem serve`: empty keys refused, key files, the exposure check, and the
refusal reaching the command line before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cluster.api_keys import check_exposure, collect_keys, is_loopback, read_key_file

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-Very-Secret-0123456789"


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_an_empty_or_blank_key_is_refused(key):
    with pytest.raises(ValueError, match=r"--api-key #1 is empty"):
        collect_keys([key])
    with pytest.raises(ValueError, match=r"\$TANDEM_API_KEY is empty"):
        collect_keys(environ={"TANDEM_API_KEY": key})


@pytest.mark.parametrize("key,what", [("two words", "whitespace"), ("tab\tkey", "whitespace"),
                                      ("clé-secrète", "non-ASCII"), ("bell\x07", "control")])
def test_keys_a_bearer_header_cannot_carry_are_refused_without_echoing_them(key, what):
    with pytest.raises(ValueError) as err:
        collect_keys(["fine-key-1", key])
    assert "--api-key #2" in str(err.value) and what in str(err.value)
    assert key not in str(err.value)


def test_keys_from_flags_files_and_environment_are_combined_in_order(tmp_path):
    one = tmp_path / "one"
    one.write_text(f"{SECRET}\n")  # a mounted Kubernetes Secret: one key, maybe a newline
    many = tmp_path / "many"
    many.write_text("# rotated 2026-11\n\n  key-b  \nkey-c\n" + SECRET + "\n")
    env_file = tmp_path / "env"
    env_file.write_text("key-e")
    keys = collect_keys(["key-a"], [str(one), str(many)],
                        environ={"TANDEM_API_KEY": "key-d", "TANDEM_API_KEY_FILE": str(env_file)})
    assert keys == ["key-a", SECRET, "key-b", "key-c", "key-d", "key-e"]  # duplicates once
    assert collect_keys(environ={}) == []


def test_a_key_file_must_exist_and_hold_a_valid_key(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_key_file(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n   \n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(empty)
    bad = tmp_path / "bad"
    bad.write_text("good-key\nbad key\n")
    with pytest.raises(ValueError, match=r"bad:2 contains whitespace") as err:
        read_key_file(bad)
    assert "bad key" not in str(err.value)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(binary)


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                           ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                           ("::", False), ("10.1.2.3", False), ("gateway.internal", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_serving_beyond_loopback_needs_a_key_or_an_explicit_opt_out():
    assert check_exposure("127.0.0.1", [], allow_unauthenticated=False) is None
    assert check_exposure("0.0.0.0", [SECRET], allow_unauthenticated=False) is None
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0 without an API key"):
        check_exposure("0.0.0.0", [], allow_unauthenticated=False)
    warning = check_exposure("0.0.0.0", [], allow_unauthenticated=True)
    assert warning.startswith("WARNING: serving on 0.0.0.0 without an API key")


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_API_KEY")}
    environ |= {"PYTHONPATH": str(ROOT)} | (env or {})
    return subprocess.run([sys.executable, "-m", "tandem.cli.main", "serve", "--port", "1", *args],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,env,message", [
    (["--api-key", ""], None, "the API key from --api-key #1 is empty"),
    ([], {"TANDEM_API_KEY": "  "}, "the API key from $TANDEM_API_KEY is empty"),
    (["--api-key-file", "/nonexistent/key"], None, "API key file '/nonexistent/key' does not exist"),
    (["--host", "0.0.0.0"], None, "refusing to serve on 0.0.0.0 without an API key"),
    (["--metrics-require-key"], None, "--metrics-require-key needs an API key"),
])
def test_tandem_serve_refuses_at_start_up_before_starting_anything(args, env, message):
    proc = _serve(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"tandem: error: {message}" in proc.stderr
    assert "starting Ray" not in proc.stderr and "preparing" not in proc.stderr
