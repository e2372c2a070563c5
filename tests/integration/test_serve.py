"""The real thing end to end: the openai SDK against uvicorn, the gateway and a disaggregated
Ray cluster; streamed text equals the offline engine's, disconnects free everything, and
/metrics tells the truth (checked by promtool and by a real Prometheus)."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.integration.test_cluster import _config, wait_all_free

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3,"]


@pytest.fixture(scope="module")
def served(ray_session, checkpoint):
    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.engine.model.config import ModelConfig
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    cluster = Cluster(_config(checkpoint, prefill_workers=1, decode_workers=1)).start()
    mc = ModelConfig.from_dir(checkpoint)
    backend = ClusterBackend(cluster, "tiny", mc.max_position_embeddings, mc.vocab_size)
    app = create_app(backend, Tokenizer.from_dir(checkpoint), request_timeout_s=120)
    with ServerThread(app) as server:
        yield server, cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint)


def _reference(llm, prompt: str, n: int = 12) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].text


def test_openai_sdk_streams_the_offline_text(served, offline):
    import openai

    server, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    for prompt in PROMPTS:
        expected = _reference(offline, prompt)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected
        assert out.usage.completion_tokens == 12
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_async_chat_stream_matches_offline_chat(served, offline):
    import openai

    server, _ = served
    messages = [{"role": "user", "content": "Say something."}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10,
                                                     ignore_eos=True))[0].outputs[0].text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts), usage
    text, usage = asyncio.run(main())
    assert text == expected
    assert usage.completion_tokens == 10


def test_dropped_clients_leave_nothing_behind(served):
    server, cluster = served

    async def drop_after(i: int) -> None:
        body = {"model": "tiny", "prompt": PROMPTS[i % 4] * (1 + i % 3), "max_tokens": 200,
                "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen >= 1 + i % 4:
                        break  # leave mid-stream

    async def main():
        await asyncio.wait_for(asyncio.gather(*(drop_after(i) for i in range(24))), 60)
    asyncio.run(main())
    stats = wait_all_free(cluster, timeout_s=15)
    assert all(s["free_blocks"] == s["total_blocks"] and s["held"] == 0 and s["running"] == 0
               for s in stats), stats
    deadline = time.monotonic() + 10
    while cluster.router.pending_summary()["requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.router.pending_summary()["requests"] == 0


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = values.get(name, 0.0) + float(value)
    return values


def _sum(values: dict[str, float], pattern: str) -> float:
    rx = re.compile(pattern)
    return sum(v for k, v in values.items() if rx.fullmatch(k))


def _wait_for_fresh_worker_metrics(server) -> None:
    """/metrics serves the workers' families as of the last periodic refresh: wait for one
    that began after now."""
    telemetry = server.server.config.app.state.gateway.backend.telemetry
    target = telemetry.refreshes + 2
    deadline = time.monotonic() + 60
    while telemetry.refreshes < target:
        assert time.monotonic() < deadline, "the cluster snapshot stopped refreshing"
        time.sleep(0.05)


def test_metrics_count_what_was_served(served):
    server, _ = served
    before = _scrape(server.url)
    rng = random.Random(3)
    sent_tokens = 0
    for i in range(5):
        n = rng.randrange(3, 9)
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[i % 4], "max_tokens": n, "ignore_eos": True})
        assert r.status_code == 200
        sent_tokens += r.json()["usage"]["completion_tokens"]
    _wait_for_fresh_worker_metrics(server)
    after = _scrape(server.url)
    delta = lambda pattern: _sum(after, pattern) - _sum(before, pattern)  # noqa: E731
    assert delta(r'tandem_requests_total\{finish_reason="length",status="200"\}') == 5
    assert delta(r"tandem_generation_tokens_total") == sent_tokens
    assert delta(r"tandem_time_to_first_token_seconds_count") == 5
    assert delta(r'tandem_kv_transfer_bytes_total\{role="decode".*') > 0
    assert delta(r'tandem_kv_transfer_bytes_total\{role="prefill".*') == \
        delta(r'tandem_kv_transfer_bytes_total\{role="decode".*')
    assert delta(r'tandem_prefill_decisions_total\{decision="remote"\}') == 5
    # the engine threads' step CPU: what the request path's share is measured against
    assert delta(r'tandem_engine_step_cpu_seconds_total\{role="prefill".*') > 0
    assert delta(r'tandem_engine_step_cpu_seconds_total\{role="decode".*') > 0
    # one request at a time: its first token from the prefill worker, one decode step per later token
    assert delta(r'tandem_engine_steps_total\{role="decode".*') == sent_tokens - 5
    assert delta(r'tandem_engine_steps_total\{role="prefill".*') >= 5
    assert _sum(after, r'tandem_workers_ready\{role="(prefill|decode)"\}') == 2
    for family in ("queue_time_seconds_count", "prefill_time_seconds_count",
                   "kv_transfer_seconds_count", "kv_cache_free_blocks", "num_requests_running"):
        assert any(k.startswith(f"tandem_{family}") for k in after), family


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_live_metrics_pass_promtool(served):
    server, _ = served
    text = httpx.get(server.url + "/metrics", timeout=10).text
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_real_prometheus_scrapes_the_ttft_histogram(served, tmp_path):
    from tandem.gateway.server import find_free_port

    server, _ = served
    config = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    config = config.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    config = config.replace("scrape_timeout: 5s", "scrape_timeout: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copytree(ROOT / "deploy/prometheus/rules", tmp_path / "rules")
    port = find_free_port()
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3})
        query = "sum(tandem_time_to_first_token_seconds_count)"
        deadline, result = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query},
                              timeout=5)
                result = r.json()["data"]["result"]
                if result and float(result[0]["value"][1]) > 0:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        assert result and float(result[0]["value"][1]) >= 1, result
        buckets = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5, params={
            "query": "tandem_time_to_first_token_seconds_bucket"}).json()["data"]["result"]
        assert {b["metric"]["le"] for b in buckets} >= {"0.1", "1.0", "+Inf"}
    finally:
        prom.terminate()
        prom.wait(timeout=20)
