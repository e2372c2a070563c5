"""The gateway's error matrix over raw HTTP: statuses, OpenAI's error shape, limits."""

from __future__ import annotations

import json

import httpx
import pytest

from tandem.gateway import ServerThread, create_app
from tests.fake_backend import FakeBackend
from tandem.text.tokenizer import Tokenizer
from tests.gateway_helpers import MODEL, assert_error, chat, completion

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(tok) -> FakeBackend:
    return FakeBackend(model_id=MODEL, max_model_len=128, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


@pytest.fixture(scope="module")
def http(backend, tok):
    app = create_app(backend, tok, max_body_bytes=LIMIT, max_n=4, request_timeout_s=30)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
        yield c


BAD_COMPLETIONS = [
    (completion(temperature=False), "temperature"),
    (completion(max_tokens="5"), "max_tokens"),
    (completion(n=1.5), "n"),
    (completion(n=0), "n"),
    (completion(n=5), "n"),  # over max_n
    (completion(stream="yes"), "stream"),
    (completion(stop=5), "stop"),
    (completion(stop=""), "stop"),
    (completion(temperature=-1), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_k=-2), "top_k"),
    (completion(min_p=1.5), "min_p"),
    (completion(presence_penalty=3), "presence_penalty"),
    (completion(repetition_penalty=0), "repetition_penalty"),
    (completion(seed=-1), "seed"),
    (completion(seed=2**63), "seed"),
    (completion(logprobs=True), "logprobs"),
    (completion(logprobs=21), "logprobs"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(min_tokens=-1), "min_tokens"),
    (completion(prompt=""), "prompt"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[[]]), "prompt"),
    (completion(prompt=[1.5]), "prompt"),
    (completion(prompt=[True]), "prompt"),
    (completion(prompt=[-1]), "prompt"),
    (completion(prompt=[5000]), "prompt"),
    (completion(prompt=None), "prompt"),
    (completion(stop_token_ids=[5000]), "stop_token_ids"),
    (completion(echo=True), "echo"),
    (completion(suffix="x"), "suffix"),
    (completion(best_of=2), "best_of"),
    (completion(logit_bias={"5000": 1}), "logit_bias"),
    (completion(logit_bias={"-5": 1}), "logit_bias"),
    (completion(logit_bias={"05": 1}), "logit_bias"),
    (completion(logit_bias={"x": 1}), "logit_bias"),
    (completion(logit_bias={"5": 100.5}), "logit_bias"),
    (completion(logit_bias={"5": True}), "logit_bias"),
    (completion(logit_bias={str(t): 1 for t in range(1025)}), "logit_bias"),
    (completion(stream_options={"include_usage": "yes"}, stream=True), "stream_options"),
    ({"prompt": "no model"}, "model"),
    ({"model": 5, "prompt": "x"}, "model"),
]
BAD_CHATS = [
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (chat(logprobs=3), "logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),  # without logprobs: true
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat(response_format={"type": "json_object"}), "response_format"),
    (chat(max_completion_tokens=False), "max_completion_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=lambda x: json.dumps(x)[:60])
def test_invalid_completion_fields_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=lambda x: json.dumps(x)[:60])
def test_invalid_chat_fields_are_400(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'"text"', b"null"])
def test_malformed_bodies_are_400(http, content):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(http.post(path, content=content, headers={"content-type": "application/json"}), 400)


def test_context_overflow_names_both_numbers(http, tok):
    err = assert_error(http.post("/v1/completions", json=completion(max_tokens=200)), 400, "max_tokens",
                       "context_length_exceeded")
    n = len(tok.encode("hello"))
    assert "128" in err["message"] and str(200 + n) in err["message"] and "200" in err["message"]
    long_prompt = list(range(3, 131))  # 128 tokens: no room left
    err = assert_error(http.post("/v1/completions", json=completion(prompt=long_prompt)), 400, "prompt",
                       "context_length_exceeded")
    assert "128" in err["message"]
    big = chat(messages=[{"role": "user", "content": "word " * 200}])
    assert_error(http.post("/v1/chat/completions", json=big), 400, "messages", "context_length_exceeded")
    err = assert_error(http.post("/v1/chat/completions", json=chat(max_completion_tokens=500)), 400,
                       "max_completion_tokens")
    assert "500" in err["message"]


def test_a_prompt_that_fits_with_the_default_max_tokens_is_clamped(http):
    r = http.post("/v1/completions", json=completion(prompt=list(range(3, 123)), ignore_eos=True))  # 120 + 16 > 128
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", completion(model="gpt-4")), ("/v1/chat/completions", chat(model="x"))):
        assert_error(http.post(path, json=body), 404, "model", "model_not_found")
    assert_error(http.get("/v1/models/nope"), 404, "model")


def test_unknown_routes_and_methods(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.post("/v2/completions", json={}), 404)
    r = http.get("/v1/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]
    assert_error(http.delete("/v1/models"), 405)


def test_body_limit_by_content_length_and_by_streamed_size(http):
    big = completion(prompt="x" * (LIMIT + 10))
    assert_error(http.post("/v1/completions", json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: chunked transfer encoding
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    assert_error(http.post("/v1/completions", content=chunks()), 413, code="request_too_large")
    ok = completion(prompt="x" * (LIMIT // 2), max_tokens=2)
    assert http.post("/v1/completions", json=ok).status_code in (200, 400)  # under the limit: parsed


def test_health_ready_metrics_and_openapi(http, backend):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200
    backend.is_ready = False
    try:
        assert http.get("/ready").status_code == 503
    finally:
        backend.is_ready = True
    r = http.get("/metrics")
    assert r.status_code == 200 and "python_info" in r.text and r.headers["content-type"].startswith("text/plain")
    spec = http.get("/openapi.json").json()
    ops = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "text/event-stream" in ops["200"]["content"] and "application/json" in ops["200"]["content"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(ops) and "422" not in ops
    assert "Retry-After" in ops["429"]["headers"]
