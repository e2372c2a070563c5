"""Errors that come from behind the gateway: backend failures, deadlines, readiness; and API keys."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tandem.gateway import ServerThread, create_app
from tests.fake_backend import FakeBackend
from tandem.router.errors import ClusterFullError, NoWorkersError, PromptTooLargeError
from tandem.text.tokenizer import Tokenizer
from tests.gateway_helpers import MODEL, assert_error, chat, completion



@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(tok) -> FakeBackend:
    return FakeBackend(model_id=MODEL, max_model_len=128, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


class _Probe:
    def __init__(self, behaviour):
        self.model_id, self.max_model_len, self.vocab_size = MODEL, 64, 1024
        self.behaviour = behaviour

    def generate(self, request_id, prompt_token_ids, params):
        raise AssertionError("not used")

    async def ready(self):
        if self.behaviour == "raise":
            raise RuntimeError("pools down")
        await asyncio.sleep(30)
        return True


@pytest.mark.parametrize("behaviour", ["raise", "hang"])
def test_ready_is_503_when_the_probe_fails_or_hangs(tok, behaviour):
    with ServerThread(create_app(_Probe(behaviour), tok, ready_timeout_s=0.2)) as srv:
        r = httpx.get(srv.url + "/ready", timeout=5)
        assert r.status_code == 503 and httpx.get(srv.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def keyed(backend, tok):
    app = create_app(backend, tok, api_keys=["key-one", "key-two"])
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer nope"}, {"authorization": "Basic key-one"},
                                     {"authorization": "Bearer"}, {"authorization": "key-one"},
                                     {"authorization": "Bearer key-one-and-more"}])
def test_api_keys_reject_missing_and_wrong_keys(keyed, headers):
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/nope"),
                         ("GET", "/openapi.json")):
        r = keyed.request(method, path, json=completion(max_tokens=1), headers=headers)
        assert_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"


def test_api_keys_accept_every_configured_key_and_leave_probes_open(keyed):
    for key in ("key-one", "key-two"):
        r = keyed.post("/v1/completions", json=completion(max_tokens=2), headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200
    for path in ("/health", "/ready", "/metrics"):
        assert keyed.get(path).status_code == 200
    c = openai.OpenAI(base_url=str(keyed.base_url) + "/v1", api_key="key-two", max_retries=0)
    assert c.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(keyed.base_url) + "/v1", api_key="bad", max_retries=0).models.list()


@pytest.mark.parametrize(("exc", "status", "retry_after"), [
    (ClusterFullError("decode pool full", retry_after_s=2.2), 429, "3"),
    (ClusterFullError("decode pool full", retry_after_s=0.01), 429, "1"),
    (NoWorkersError("no decode worker alive", retry_after_s=5), 503, "5"),
    (PromptTooLargeError("needs 90 blocks, the largest worker has 64"), 400, None),
    (ValueError("refused by the worker"), 400, None),
    (RuntimeError("bug"), 500, None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors_map_to_statuses(tok, exc, status, retry_after, stream):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, fail=exc)
    with ServerThread(create_app(fake, tok)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=completion(stream=stream), timeout=10)
        assert_error(r, status)
        assert r.headers.get("retry-after") == retry_after
        assert fake.running() == []
        if status == 429:
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                    model=MODEL, prompt="x")


def _events(r: httpx.Response) -> list:
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [f[6:] if f == "data: [DONE]" else json.loads(f[6:]) for f in frames]


def test_error_after_the_stream_started_is_an_sse_event(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, fail=ClusterFullError("worker lost", 1),
                       fail_after=3, tokens_per_delta=1)
    with ServerThread(create_app(fake, tok)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat(stream=True, max_tokens=10, ignore_eos=True))
    assert r.status_code == 200
    events = _events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "cluster_full"
    assert all("choices" in e for e in events[:-2])
    assert fake.running() == []


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_before_the_first_token_is_504(tok, stream):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, hang_after=0)
    with ServerThread(create_app(fake, tok, request_timeout_s=0.3)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=completion(stream=stream), timeout=10)
        assert_error(r, 504, code="request_timeout")
        assert fake.running() == [] and all(q.aborted for q in fake.requests.values())


def test_deadline_mid_stream_ends_with_an_error_event(tok):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, hang_after=2)
    # the backend hangs after 2 tokens: the deadline, however long, comes after them
    with ServerThread(create_app(fake, tok, request_timeout_s=2.0)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=completion(stream=True, max_tokens=10, ignore_eos=True),
                       timeout=10)
        events = _events(r)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) != ""
        assert fake.running() == []


def test_server_side_abort_is_503(tok):
    from tandem.common.sampling_params import FinishReason
    from tandem.protocol.request_path import TokenDelta

    class Aborting(FakeBackend):
        async def _stream(self, rec):
            try:
                yield TokenDelta(rec.request_id, (5,), 0, True, FinishReason.ABORT)
            finally:
                rec.closed = True

    with ServerThread(create_app(Aborting(model_id=MODEL), tok)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=completion(), timeout=10)
        assert_error(r, 503, code="aborted")
