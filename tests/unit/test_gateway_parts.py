"""The gateway's parts without a server: generation, detokenization at the edge, errors, limits."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from fastapi.testclient import TestClient

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.gateway import create_app
from tandem.gateway.errors import APIError, from_backend_error, retry_after
from tests.fake_backend import FakeBackend
from tandem.gateway.generation import ChoiceJob, ClientDisconnected, Generation
from tandem.gateway.logprobs import LOGPROB_FLOOR, TokenStrings, clamp
from tandem.gateway.middleware import ApiKeyMiddleware
from tandem.gateway.sampling import max_tokens_for
from tandem.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tandem.protocol.request_path import TokenDelta
from tandem.router.errors import ClusterFullError, NoWorkersError, PromptTooLargeError
from tandem.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def run_gen(backend, tok, jobs, **kw):
    async def go():
        gen = Generation(backend, tok, "r", jobs, **kw)
        try:
            await gen.start()
            return await gen.collect(), gen.completion_tokens
        finally:
            await gen.close()
    return asyncio.run(go())


def test_generation_collects_choices_and_counts_tokens(tok):
    fake = FakeBackend(vocab_size=tok.vocab_size, tokens_per_delta=3)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    results, n = run_gen(fake, tok, [ChoiceJob(0, [5], p), ChoiceJob(1, [9], p)])
    assert [r.index for r in results] == [0, 1]
    for r, prompt in zip(results, ([5], [9])):
        assert r.text == tok.decode(fake.tokens(prompt, p)) and r.finish_reason == "length"
    assert n == 20 and not fake.running()


def test_stop_string_inside_a_multi_token_delta_drops_the_rest(tok):
    fake = FakeBackend(vocab_size=tok.vocab_size, tokens_per_delta=8)
    base = SamplingParams(max_tokens=30, ignore_eos=True)
    toks = fake.tokens([7], base)
    full = tok.decode(toks)
    k = next(i for i in range(3, 20) if tok.decode(toks[:i]) != tok.decode(toks[:i - 1]) and
             full.find(tok.decode([toks[i - 1]])) == len(tok.decode(toks[:i - 1])))
    stop = tok.decode([toks[k - 1]])
    p = SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,))
    (r,), n = run_gen(fake, tok, [ChoiceJob(0, [7], p)])
    assert r.text == full[:full.find(stop)] and r.finish_reason == "stop"
    assert n == r.token_ids.__len__() <= k
    (req,) = fake.requests.values()
    assert req.aborted


def test_eos_and_stop_token_text_is_hidden_and_counted(tok):
    eos = min(tok.eos_token_ids)
    script = tok.encode("abc def") + [eos]
    fake = FakeBackend(vocab_size=tok.vocab_size, script=script, eos_token_ids=tok.eos_token_ids)
    (r,), n = run_gen(fake, tok, [ChoiceJob(0, [5], SamplingParams(max_tokens=20, skip_special_tokens=False))])
    assert r.text == "abc def" and r.finish_reason == "stop" and n == len(script)
    stop_tok = tok.encode(" def")[0]
    (r,), _ = run_gen(FakeBackend(vocab_size=tok.vocab_size, script=script), tok,
                      [ChoiceJob(0, [5], SamplingParams(max_tokens=20, stop_token_ids=(stop_tok,)))])
    assert r.text == "abc" and r.finish_reason == "stop"


class _Redriven:
    """Sends a duplicate after a re-drive, as the cluster's driver may."""

    model_id, max_model_len, vocab_size = "m", 64, 1024

    async def ready(self):
        return True

    async def generate(self, request_id, prompt_token_ids, params):
        a, b, c = 300, 301, 302
        yield TokenDelta(request_id, (a, b), 0)
        yield TokenDelta(request_id, (b, c), 1, True, FinishReason.LENGTH)


def test_duplicated_tokens_after_a_redrive_are_dropped(tok):
    (r,), n = run_gen(_Redriven(), tok, [ChoiceJob(0, [5], SamplingParams(max_tokens=3))])
    assert r.token_ids == [300, 301, 302] and r.text == tok.decode([300, 301, 302]) and n == 3


@pytest.mark.parametrize(("exc", "status"), [(ClusterFullError("x", 1), 429), (NoWorkersError("x", 1), 503),
                                             (PromptTooLargeError("x"), 400), (ValueError("x"), 400),
                                             (KeyError("x"), 500)])
def test_start_raises_the_mapped_error_and_closes_everything(tok, exc, status):
    fake = FakeBackend(vocab_size=tok.vocab_size, fail=exc)
    with pytest.raises(APIError) as info:
        run_gen(fake, tok, [ChoiceJob(i, [5], SamplingParams()) for i in range(3)])
    assert info.value.status == status and not fake.running()


def test_deadline_and_disconnect_sentinels(tok):
    async def go(**kw):
        fake = FakeBackend(vocab_size=tok.vocab_size, hang_after=0)
        gen = Generation(fake, tok, "r", [ChoiceJob(0, [5], SamplingParams())], **kw)
        try:
            await gen.start()
        finally:
            await gen.close()
            assert not fake.running()

    with pytest.raises(APIError) as info:
        asyncio.run(go(timeout_s=0.05))
    assert info.value.status == 504

    async def disconnect():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    with pytest.raises(ClientDisconnected):
        asyncio.run(go(receive=disconnect))


def test_retry_after_is_a_whole_number_of_seconds_at_least_one():
    assert [retry_after(s) for s in (0, 0.01, 1, 1.2, 30)] == ["1", "1", "1", "2", "30"]
    assert retry_after(math.inf) == "1" and retry_after(math.nan) == "1"
    e = from_backend_error(ClusterFullError("full", 4.5))
    assert e.status == 429 and e.headers == {"Retry-After": "5"}
    assert e.body()["error"]["type"] == "rate_limit_error"


def test_max_tokens_rules():
    assert max_tokens_for(None, 10, 100, default=16) == 16
    assert max_tokens_for(None, 90, 100, default=16) == 10  # a default is clamped
    assert max_tokens_for(None, 10, 100, default=None) == 90
    assert max_tokens_for(90, 10, 100, default=16) == 90
    with pytest.raises(APIError, match="100 tokens.*101 were requested"):
        max_tokens_for(91, 10, 100, default=16)
    with pytest.raises(APIError, match="100 tokens"):
        max_tokens_for(None, 100, 100, default=16)


def test_logprob_rendering(tok):
    assert clamp(-math.inf) == LOGPROB_FLOOR and clamp(math.nan) == LOGPROB_FLOOR and clamp(-0.5) == -0.5
    strings = TokenStrings(tok)
    (piece,) = [t for t in tok.encode("日") if tok.token_bytes(t) and len(tok.token_bytes(t)) == 1][:1]
    text, data, width = strings.get(piece)
    assert text.startswith("bytes:\\x") and len(data) == 1 and width == 0
    hello = tok.encode("hello")[0]
    assert strings.get(hello)[0] == tok.decode([hello])


@pytest.mark.parametrize("field,value", [("temperature", False), ("max_tokens", "5"), ("n", 1.5),
                                         ("stream", 1), ("top_k", 2.5), ("seed", True),
                                         ("max_tokens", float("inf")), ("prompt", [1, 2.5])])
def test_request_models_are_strict(field, value):
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    ok = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 1, "future_field": 1})
    assert ok.temperature == 1.0
    as_json_schema = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2.0], "top_k": 2.0})
    assert as_json_schema.top_k == 2 and as_json_schema.prompt == [1, 2]  # 2.0 is an integer in JSON Schema
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": 5}]})


def test_every_key_is_compared(monkeypatch):
    calls = []
    import hmac
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(b) or real(a, b))
    mw = ApiKeyMiddleware(None, api_keys=["a", "b", "c"])
    assert mw._authorized({"headers": [(b"authorization", b"Bearer a")]})
    assert calls == [b"a", b"b", b"c"]  # no early exit on the first match
    assert not mw._authorized({"headers": [(b"authorization", b"Bearer d")]})


def test_create_app_validates_its_arguments(tok):
    fake = FakeBackend()
    for kw in ({"max_n": 0}, {"max_body_bytes": -1}, {"request_timeout_s": 0}, {"api_keys": "one-key"}):
        with pytest.raises(ValueError):
            create_app(fake, tok, **kw)


def test_in_process_client_works_too(tok):
    fake = FakeBackend(vocab_size=tok.vocab_size)
    with TestClient(create_app(fake, tok)) as c:
        r = c.post("/v1/completions", json={"model": fake.model_id, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        r = c.post("/v1/completions", json={"model": fake.model_id, "prompt": "hi", "stream": True})
        assert r.text.endswith("data: [DONE]\n\n")


def test_ready_answers_503_while_draining(tok):
    app = create_app(FakeBackend(vocab_size=tok.vocab_size), tok)
    with TestClient(app) as c:
        assert c.get("/ready").status_code == 200
        app.state.gateway.draining = True
        r = c.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        assert c.get("/health").status_code == 200


def test_sse_frames_escape_what_clients_take_for_line_breaks():
    from tandem.gateway.sse import frame

    text = "a\u2028b\u2029c\x85d\nе\r\x1c"
    data = frame({"choices": [{"text": text}]})
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    line = data[len(b"data: "):-2].decode()
    assert line.splitlines() == [line]  # one line for str.splitlines, httpx and the SSE spec alike
    assert json.loads(line)["choices"][0]["text"] == text


# (field, the largest / smallest accepted values, the nearest refused ones): the request schema and
# SamplingParams draw the same lines (the gateway then narrows some to the served model and server)
BOUNDS = [
    ("temperature", [0, 0.01, 2], [-1e-9, 0.009, 2.0001, 1e-300]),
    ("top_p", [1e-300, 1], [0, 1.0001]),
    ("min_p", [0, 1], [-0.1, 1.1]),
    ("presence_penalty", [-2, 2], [-2.01, 2.01, 1e308]),
    ("frequency_penalty", [-2, 2], [-2.01, 2.01, -1e308]),
    ("repetition_penalty", [0.01, 10], [0.0099, 10.01, 1e308, 1e-300]),
    ("top_k", [-1, 0, 1, 2**31 - 1], [-2, 2**31, 10**20]),
    ("logprobs", [0, 20], [-1, 21]),
    ("max_tokens", [1, 2**31 - 1], [0, 2**31, 10**20]),
    ("stop", [["s" * 256] * 16], [["s" * 257], ["s"] * 17, [""]]),
    ("stop_token_ids", [[0] * 256], [[-1], [0] * 257]),
]


@pytest.mark.parametrize(("field", "accepted", "refused"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_request_schema_and_sampling_params_agree_on_bounds(field, accepted, refused):
    for value in accepted:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
        SamplingParams(**{field: value})
    for value in refused:
        with pytest.raises(ValueError):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
        with pytest.raises(ValueError):
            SamplingParams(**{field: value})


def test_seeds_are_json_integers_at_the_gateway_and_63_bit_in_sampling_params():
    from tandem.gateway.schemas import MAX_JSON_SEED

    assert MAX_JSON_SEED == 2**53 - 1
    CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": MAX_JSON_SEED})
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": MAX_JSON_SEED + 1})
    SamplingParams(seed=2**63 - 1)
    for seed in (-1, 2**63):
        with pytest.raises(ValueError):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 101, 1000, 1024, 32000, 49152, 128256])
def test_the_token_id_key_pattern_matches_exactly_the_ids_below_the_vocabulary(n):
    import random
    import re

    from tandem.gateway.openapi import integer_below_pattern

    pattern = re.compile(integer_below_pattern(n))
    rng = random.Random(n)
    for k in [*range(min(n + 30, 2100)), *(rng.randrange(10 * n + 10) for _ in range(2000)), n, n + 1, 10 * n]:
        assert bool(pattern.fullmatch(str(k))) == (k < n), (n, k)
    assert not any(pattern.fullmatch(s) for s in ("00", "01", "-1", "+1", "1.0", "", " 1", "1e2"))
