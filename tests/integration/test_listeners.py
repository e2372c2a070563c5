"""What `tandem serve` exposes: every listening socket of its process tree (the gateway, Ray's
GCS, raylet, agents and workers, gloo's store and pair sockets), found with psutil.

- `tandem serve` (host 127.0.0.1): every socket on loopback; the API key comes from a file.
- `tandem serve --host 0.0.0.0 --allow-unauthenticated`: the API port is the only socket
  beyond loopback, and start-up warns that the API is open.

Each server is a real `tandem serve` process in a session of its own; every process of its
tree is ended when the test ends, whatever happens.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900  # a loaded 2-core machine: model, Ray, two workers, transfer group
KEY = "sk-listeners-0123456789"


def _free_port() -> int:
    from tandem.gateway.server import find_free_port

    return find_free_port("127.0.0.1")


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _listeners(procs: list[psutil.Process]) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of ``procs``."""
    found = set()
    for p in procs:
        try:
            name = p.name()
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found.add((c.laddr.ip, c.laddr.port, name))
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1
    return ip.is_loopback


class ProcessTree:
    """A process started in a session of its own; remembers every process of its tree so
    ``stop()`` can end them all, even those that outlive their parent."""

    def __init__(self, proc: subprocess.Popen, stop_grace_s: float) -> None:
        self.proc, self.stop_grace_s = proc, stop_grace_s
        self.root = psutil.Process(proc.pid)
        self.seen: dict[int, psutil.Process] = {}

    def remember(self) -> list[psutil.Process]:
        procs = _tree(self.root)
        self.seen |= {p.pid: p for p in procs}
        return procs

    def stop(self) -> None:
        """SIGTERM, ``stop_grace_s`` to end cleanly, then kill what is left of the tree."""
        self.remember()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
        leftovers = [p for p in self.seen.values() if p.is_running()]
        for p in leftovers:  # only processes of this tree
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class Served(ProcessTree):
    """`tandem serve ARGS` in its own session; ``stop()`` ends every process it started."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = _free_port()
        self.log = tmp_path / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_API_KEY")}
        env |= {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
        cmd = [sys.executable, "-m", "tandem.cli.main", "serve", "--port", str(self.port),
               "--kv-cache-gb", "0.25", *args]
        with open(self.log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        super().__init__(proc, stop_grace_s=120)  # SIGTERM: drains, then shuts its Ray down

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self.remember()
            if self.proc.poll() is not None:
                pytest.fail(f"tandem serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(url + "/ready", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tandem serve not ready within {START_TIMEOUT_S} s:\n{self.log.read_text()}")
            time.sleep(1)


@pytest.fixture
def serve(tmp_path):
    started: list[Served] = []

    def start(*args: str) -> Served:
        s = Served(tmp_path, *args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _assert_tree_listens(served: Served, exposed_ports: set[int]) -> set[tuple[str, int, str]]:
    listeners = _listeners(served.remember())
    names = {name for _, _, name in listeners}
    # the whole tree is there: gateway, GCS, raylet, both workers (gloo sockets included)
    assert {"gcs_server", "raylet"} <= names, listeners
    assert any("PrefillWorker" in n for n in names) and any("DecodeWorker" in n for n in names), listeners
    beyond = {(a, p, n) for a, p, n in listeners if not _is_loopback(a)}
    assert {p for _, p, _ in beyond} == exposed_ports, f"listening beyond loopback: {sorted(beyond)}"
    return listeners


def test_a_local_run_listens_on_loopback_only(serve, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    served = serve("--api-key-file", str(key_file))
    url = f"http://127.0.0.1:{served.port}"
    served.wait_ready(url)
    listeners = _assert_tree_listens(served, exposed_ports=set())
    assert ("127.0.0.1", served.port, served.root.name()) in listeners

    # the key from the file guards the API; the probes stay open
    import openai

    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1
    log = served.log.read_text()
    assert KEY not in log and "WARNING" not in log


def test_a_public_api_port_exposes_nothing_else(serve):
    served = serve("--host", "0.0.0.0", "--allow-unauthenticated")
    url = f"http://127.0.0.1:{served.port}"
    served.wait_ready(url)
    _assert_tree_listens(served, exposed_ports={served.port})
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
    assert "WARNING: serving on 0.0.0.0 without an API key" in served.log.read_text()
