"""Client disconnects and server shutdown abort backend requests; nothing is left running."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tandem.gateway import ServerThread, create_app
from tests.fake_backend import FakeBackend
from tandem.text.tokenizer import Tokenizer

MODEL = "fake-model"


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def wait_until(cond, timeout_s: float = 30.0) -> bool:  # a hang guard: each condition comes soon
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def body(stream: bool = True, **kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": stream, **kw}


def test_many_streaming_clients_dropping_mid_stream_abort_every_request(tok):
    fake = FakeBackend(model_id=MODEL, max_model_len=512, vocab_size=tok.vocab_size, delay_s=0.01)
    clients = 64
    with ServerThread(create_app(fake, tok)) as srv:
        async def one(i: int, client: httpx.AsyncClient) -> int:
            path, payload = (("/v1/chat/completions", {**body(n=2), "messages": [{"role": "user", "content": "x"}]})
                             if i % 4 == 0 else ("/v1/completions", body()))
            got = 0
            async with client.stream("POST", path, json=payload) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    got += line.startswith("data: ")
                    if got >= 3 + i % 5:
                        break  # leaving the block closes the connection mid-stream
            return got

        async def run() -> list[int]:
            limits = httpx.Limits(max_connections=clients)
            async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=20) as client:
                return await asyncio.gather(*(one(i, client) for i in range(clients)))

        counts = asyncio.run(run())
        assert all(c >= 3 for c in counts)
        assert wait_until(lambda: not fake.running()), fake.running()
        assert len(fake.requests) == clients + clients // 4  # chat requests ask for n=2
        assert all(r.aborted for r in fake.requests.values())
        assert max(r.sent for r in fake.requests.values()) < 100  # stopped long before max_tokens
        assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_waiting_for_the_first_token(tok, stream):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, hang_after=0)
    with ServerThread(create_app(fake, tok)) as srv:
        async def run() -> None:
            async with httpx.AsyncClient(base_url=srv.url) as client:
                post = asyncio.ensure_future(client.post("/v1/completions", json=body(stream, n=3)))
                deadline = time.monotonic() + 30
                while len(fake.requests) < 3:  # all three choices wait for their first token
                    assert time.monotonic() < deadline and not post.done(), "the backend never got the request"
                    await asyncio.sleep(0.01)
                post.cancel()  # the client gives up: its connection closes
                with pytest.raises(asyncio.CancelledError):
                    await post

        asyncio.run(run())
        assert wait_until(lambda: not fake.running()), fake.running()
        assert len(fake.requests) == 3
        assert all(r.aborted for r in fake.requests.values())


def test_raw_socket_close_mid_stream(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, hang_after=3)
    with ServerThread(create_app(fake, tok)) as srv:
        payload = httpx.Request("POST", srv.url + "/v1/completions", json=body()).read()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        with socket.create_connection((srv.host, srv.port)) as s:
            s.sendall(head + payload)
            assert b"200 OK" in s.recv(4096)
            assert wait_until(lambda: any(r.sent == 3 for r in fake.requests.values()))
        # the backend is stuck after 3 tokens: only the disconnect can end the request
        assert wait_until(lambda: not fake.running()), fake.running()
        assert all(r.aborted for r in fake.requests.values())


def test_shutdown_drains_in_flight_streams(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, delay_s=0.02)
    srv = ServerThread(create_app(fake, tok), drain_timeout_s=10).start()
    frames: list[str] = []

    def consume() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body(max_tokens=40), timeout=20) as r:
            frames.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=consume)
    t.start()
    assert wait_until(lambda: any(r.sent >= 3 for r in fake.requests.values()))
    srv.stop()  # like SIGTERM: stop accepting, let the stream finish
    t.join(10)
    assert frames[-1] == "data: [DONE]" and '"finish_reason":"length"' in frames[-2]
    (req,) = fake.requests.values()
    assert req.finished and req.sent == 40 and not fake.running()
    assert srv.server.config.app.state.gateway.draining
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


def test_shutdown_past_the_drain_timeout_aborts_what_is_left(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, hang_after=2)
    srv = ServerThread(create_app(fake, tok), drain_timeout_s=0.3).start()
    got: list[str] = []

    def consume() -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body(), timeout=20) as r:
                got.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=consume)
    t.start()
    assert wait_until(lambda: any(r.sent >= 2 for r in fake.requests.values()))
    srv.stop()  # raises if the server has not stopped within its own 30 s
    t.join(10)
    assert not t.is_alive()
    assert not fake.running() and all(r.aborted for r in fake.requests.values())
    # cut at the drain timeout (an error event, then [DONE]), not cancelled later with the
    # connection dropped mid-stream as uvicorn's own graceful-shutdown timeout would
    assert got[-1] == "data: [DONE]", got
    assert json.loads(got[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down", got


_SERVE_SCRIPT = """
import sys
from tandem.gateway import create_app, serve
from tests.fake_backend import FakeBackend
from tandem.text.tokenizer import Tokenizer
tok = Tokenizer.from_dir(sys.argv[1])
app = create_app(FakeBackend(model_id="fake-model", vocab_size=tok.vocab_size, delay_s=0.02), tok)
serve(app, "127.0.0.1", int(sys.argv[2]), drain_timeout_s=10, log_level="warning")
print("serve returned", flush=True)
"""


def test_sigterm_drains_the_stream_then_serve_returns(tiny_model_dir):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tandem.gateway import find_free_port

    port = find_free_port()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_SCRIPT, str(tiny_model_dir), str(port)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, 30), proc.stderr.read() if proc.poll() is not None else "not up"
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body(max_tokens=30), timeout=20) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 3:  # once: a second signal forces the exit
                    proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert "serve returned" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
