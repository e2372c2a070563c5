"""Shutdown past the drain timeout cuts what is left cleanly: a stream ends with an SSE
error event and [DONE], a non-streaming request gets a 503, the backend requests are
aborted; what finishes within the drain timeout is not cut."""

from __future__ import annotations

import json
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


def _wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.01)
    return cond()


def _body(stream: bool, max_tokens: int = 200) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}


def test_streams_cut_by_shutdown_end_with_an_error_event_and_done(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, hang_after=2)
    srv = ServerThread(create_app(fake, tok), drain_timeout_s=0.3).start()
    lines: list[str] = []
    plain: list[httpx.Response] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json=_body(True), timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line)

    def whole() -> None:
        plain.append(httpx.post(srv.url + "/v1/completions", json=_body(False), timeout=30))

    clients = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in clients:
        t.start()
    assert _wait_until(lambda: len(fake.requests) == 2
                       and all(r.sent >= 2 for r in fake.requests.values()))
    srv.stop()
    for t in clients:
        t.join(10)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert plain[0].status_code == 503
    assert plain[0].json()["error"]["code"] == "server_shutting_down"
    assert not fake.running() and all(r.aborted for r in fake.requests.values())


def test_a_stream_that_finishes_within_the_drain_timeout_is_not_cut(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, delay_s=0.02)
    srv = ServerThread(create_app(fake, tok), drain_timeout_s=20).start()
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json=_body(True, 30),
                          timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=stream)
    t.start()
    assert _wait_until(lambda: any(r.sent >= 2 for r in fake.requests.values()))
    srv.stop()
    t.join(10)
    assert lines[-1] == "data: [DONE]"
    assert all("error" not in json.loads(line.removeprefix("data: "))
               for line in lines[:-1])
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
