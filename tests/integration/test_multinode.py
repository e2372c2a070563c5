"""tandem across two Ray nodes: a real two-node Ray cluster on this machine (a head and a
worker node, each its own `ray start` with its own custom resource, loopback only, Ray
token authentication on), and `tandem serve --ray-address` placing the prefill worker on
one node and the decode worker on the other by those resources, each sizing its torch
threads on its own node. The KV crosses nodes over gloo/TCP; the real OpenAI client gets
the offline engine's outputs; each worker's transfer metrics count the KV bytes, and the
workers report different Ray node ids; `tandem drain --node` from another process
reaches the gateway through Ray.

Every process of both nodes and of the gateway is ended when the test ends, whatever
happens (by process id: other Ray clusters on the machine are left alone).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.worker.threads import usable_cores
from tests.integration.test_cluster import block_bytes
from tests.integration.test_listeners import ProcessTree, Served, _is_loopback, _listeners

psutil = pytest.importorskip("psutil")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NODE_START_TIMEOUT_S = 120
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3,", "A long prompt that spans more than one block of sixteen tokens: " * 3]
MAX_TOKENS = 12
PREFILL_NODE_CPUS = 2  # the prefill worker's node advertises 2 CPUs to Ray, the decode's 1

# `ray start`, except that this machine's loopback address stays the node address. Ray
# turns 127.0.0.1 into the host's network address when it resolves --address and
# --node-ip-address (a real multi-node cluster needs that); then every node would listen
# on all interfaces. With the node address on loopback, Ray binds its servers there.
RAY_START = """
import sys
from ray._private import services
services.get_node_ip_address = lambda address=None: "127.0.0.1"
from ray.scripts.scripts import main
sys.argv[0] = "ray"
main()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNode(ProcessTree):
    """One `ray start --block` in a session of its own; ``stop()`` ends its process tree."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, num_cpus: int = 1) -> None:
        self.log = log
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-c", RAY_START, "start", "--block",
                                     "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
                                     "--object-store-memory", str(100 << 20),
                                     "--disable-usage-stats", *args],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        super().__init__(proc, stop_grace_s=30)  # SIGTERM: ray start --block stops its node


def _wait_for_port(port: int, node: RayNode) -> None:
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            pytest.fail(f"ray start exited with {node.proc.returncode}:\n{node.log.read_text()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    pytest.fail(f"the Ray head did not listen within {NODE_START_TIMEOUT_S}s:\n"
                f"{node.log.read_text()}")


@pytest.fixture
def two_nodes(monkeypatch, tmp_path):
    """A head node with ``tandem_prefill: 1`` and ``PREFILL_NODE_CPUS`` CPUs, and a worker
    node with ``tandem_decode: 1`` and one CPU.

    Yields the GCS address; the environment (token, PYTHONPATH) is set in this process
    too, so that a `tandem serve` started from here inherits it.
    """
    temp_dir = tempfile.mkdtemp(prefix="tdm-", dir="/tmp")  # short: Ray's socket paths
    token = Path(temp_dir) / "token"
    token.write_text(secrets.token_hex(32))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT),
           # the machine is shared: Ray must not kill these workers for memory others use
           "RAY_memory_monitor_refresh_ms": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("GLOO_SOCKET_IFNAME", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    node_env = dict(os.environ)
    port = _free_port()
    nodes: list[RayNode] = []
    try:
        nodes.append(RayNode(["--head", "--port", str(port), "--include-dashboard", "false",
                              "--temp-dir", temp_dir, "--resources", '{"tandem_prefill": 1}'],
                             node_env, tmp_path / "head.log", num_cpus=PREFILL_NODE_CPUS))
        _wait_for_port(port, nodes[0])
        nodes.append(RayNode(["--address", f"127.0.0.1:{port}", "--temp-dir", temp_dir,
                              "--resources", '{"tandem_decode": 1}'],
                             node_env, tmp_path / "worker.log"))
        yield f"127.0.0.1:{port}", nodes
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _samples(text: str, name: str) -> dict[str, tuple[dict[str, str], float]]:
    """``{worker: (labels, value)}`` of one metric in a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["worker"]] = (s.labels, s.value)
    return out


def _metrics_once_counted(url: str, kv_bytes: float, timeout_s: float = 60.0) -> str:
    """The first /metrics page whose snapshot counts ``kv_bytes`` on both workers, the
    sender and the receiver, whose snapshots refresh apart (or the last one read, after
    ``timeout_s``: the assertions then say what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = httpx.get(url + "/metrics", timeout=30).text
        counted = [v for _, v in _samples(page, "tandem_kv_transfer_bytes_total").values()]
        if counted.count(kv_bytes) >= 2 or time.monotonic() > deadline:
            return page
        time.sleep(0.5)


def test_prefill_and_decode_on_two_nodes_match_the_offline_engine(two_nodes, checkpoint, tmp_path):
    import openai

    address, nodes = two_nodes
    served = Served(tmp_path, "--model", checkpoint, "--ray-address", address,
                    "--prefill-resource", "tandem_prefill=1",
                    "--decode-resource", "tandem_decode=1")
    try:
        url = f"http://127.0.0.1:{served.port}"
        served.wait_ready(url)
        offline = LLM(checkpoint)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

        async def one(client, i: int, prompt: str) -> tuple[str, int]:
            kw = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                      extra_body={"ignore_eos": True})
            if i % 2:  # half streamed, half not; all at once
                stream = await client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw)
                text, usage = "", None
                async for chunk in stream:
                    text += "".join(c.text for c in chunk.choices)
                    usage = chunk.usage or usage
                return text, usage.prompt_tokens
            out = await client.completions.create(**kw)
            return out.choices[0].text, out.usage.prompt_tokens

        async def run_all() -> list[tuple[str, int]]:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                          max_retries=0, timeout=120) as client:
                return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(PROMPTS)))

        results = asyncio.run(run_all())
        assert [text for text, _ in results] == expected

        # the workers sit on different Ray nodes (the worker families in /metrics are a
        # snapshot the gateway refreshes every 2 s: read one taken after the requests)
        sent = sum(-(-prompt_tokens // 16) for _, prompt_tokens in results) * block_bytes(checkpoint)
        page = _metrics_once_counted(url, sent)
        nodes_of = {w: labels for w, (labels, _) in
                    _samples(page, "tandem_worker_node_info").items()}
        assert set(nodes_of) == {"prefill-0", "decode-0"}, page
        assert nodes_of["prefill-0"]["node_id"] != nodes_of["decode-0"]["node_id"]
        assert {n["node_ip"] for n in nodes_of.values()} == {"127.0.0.1"}
        # no thread count was set: each worker took its node's CPUs (at most this
        # machine's usable cores), one worker a node by its pool's resource
        threads = {w: v for w, (_, v) in _samples(page, "tandem_worker_threads").items()}
        assert threads == {"prefill-0": min(PREFILL_NODE_CPUS, usable_cores()), "decode-0": 1}, page
        # the KV crossed: every prompt block sent by P's node and received on D's node
        kv = _samples(page, "tandem_kv_transfer_bytes_total")
        assert kv["prefill-0"][1] == sent and kv["decode-0"][1] == sent, kv

        # loopback only: Ray's servers on both nodes, the workers' gloo sockets, the gateway
        procs = [p for node in nodes for p in node.remember()] + served.remember()
        names = {n for _, _, n in _listeners(procs)}
        assert any("PrefillWorker" in n for n in names) and any("DecodeWorker" in n for n in names)
        beyond = {x for x in _listeners(procs) if not _is_loopback(x[0])}
        assert not beyond, f"listening beyond loopback: {sorted(beyond)}"

        # `tandem drain --node` from another process reaches the gateway through Ray; the
        # only prefill worker stays (a pool is never emptied) and the cluster serves on
        drain = subprocess.run([sys.executable, "-m", "tandem.cli.main", "drain", "--node",
                                nodes_of["prefill-0"]["node_id"], "--ray-address", address],
                               cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert drain.returncode == 1, drain.stderr[-2000:]
        assert "last prefill worker" in json.loads(drain.stdout)["prefill-0"]["error"]
        assert [text for text, _ in asyncio.run(run_all())] == expected
    except BaseException:
        print(f"--- tandem serve log:\n{served.log.read_text()[-20000:]}")
        raise
    finally:
        served.stop()
