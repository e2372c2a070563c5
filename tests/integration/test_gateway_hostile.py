"""Hostile input against a real uvicorn server (fake backend, for breadth): every request is
refused with 400/413 in OpenAI's shape, names the field, shows nothing of the server's
insides, never reaches the backend; the server serves normally afterwards. Also: backend
failures that carry tracebacks, pids, IPs and paths reach the client as fixed messages,
and tokenization neither freezes the event loop nor starts on text that cannot fit."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tandem.common.sampling_params import MAX_STOP_STRING_CHARS, SamplingParams
from tandem.gateway import ServerThread, create_app
from tandem.gateway.errors import BACKEND_ERRORS
from tests.fake_backend import FakeBackend
from tandem.router.driver import TransferError, WorkerLostError
from tandem.router.errors import ClusterFullError, NoWorkersError, PromptTooLargeError
from tandem.text.tokenizer import Tokenizer
from tests.gateway_helpers import MODEL, assert_error, assert_no_internals, chat, completion

MAX_N, MAX_PROMPTS, LIMIT = 4, 8, 1 << 20


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(tok) -> FakeBackend:
    return FakeBackend(model_id=MODEL, max_model_len=256, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


@pytest.fixture(scope="module")
def http(backend, tok):
    app = create_app(backend, tok, max_body_bytes=LIMIT, max_n=MAX_N, max_prompts=MAX_PROMPTS, request_timeout_s=30)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def raw(**fields: str) -> str:
    """A completion body with ``fields`` spliced in as raw JSON text (NaN, Infinity, 1e400 ...)."""
    body = json.dumps(completion())[:-1]
    return body + "".join(f', "{k}": {v}' for k, v in fields.items()) + "}"


HUGE = 10**20
HOSTILE_COMPLETIONS = [
    # huge numbers
    (completion(max_tokens=HUGE), "max_tokens"), (completion(top_k=HUGE), "top_k"), (completion(n=HUGE), "n"),
    (completion(seed=2**64), "seed"), (completion(seed=2**53), "seed"), (completion(logprobs=HUGE), "logprobs"), (completion(min_tokens=HUGE), "min_tokens"),
    (completion(best_of=HUGE), "best_of"), (completion(prompt=[HUGE]), "prompt"),
    (completion(stop_token_ids=[HUGE]), "stop_token_ids"), (completion(top_k=10_000), "top_k"),  # > vocabulary
    # negative numbers
    (completion(max_tokens=-1), "max_tokens"), (completion(top_k=-2), "top_k"), (completion(n=-1), "n"),
    (completion(seed=-1), "seed"), (completion(logprobs=-1), "logprobs"), (completion(min_tokens=-5), "min_tokens"),
    (completion(stop_token_ids=[-1]), "stop_token_ids"), (completion(prompt=[-7]), "prompt"),
    (completion(temperature=-0.5), "temperature"), (completion(top_p=-1), "top_p"), (completion(min_p=-0.1), "min_p"),
    # 1e308 and 1e-300
    (completion(presence_penalty=1e308), "presence_penalty"), (completion(frequency_penalty=-1e308), "frequency_penalty"),
    (completion(repetition_penalty=1e308), "repetition_penalty"), (completion(temperature=1e308), "temperature"),
    (completion(temperature=1e-300), "temperature"), (completion(repetition_penalty=1e-300), "repetition_penalty"),
    (completion(max_tokens=1e308), "max_tokens"), (completion(top_p=1e308), "top_p"),
    # integral floats are integers, but not beyond the bounds; fractional ones are not integers
    (completion(n=2.5), "n"), (completion(max_tokens=0.0), "max_tokens"),
    # enormous stop lists
    (completion(stop=["x"] * 10_000), "stop"), (completion(stop="y" * (MAX_STOP_STRING_CHARS + 1)), "stop"),
    (completion(stop=["ok", "z" * 100_000]), "stop"), (completion(stop_token_ids=[5] * 100_000), "stop_token_ids"),
    # n x prompts fan-out
    (completion(n=MAX_N + 1), "n"), (completion(prompt=["p"] * (MAX_PROMPTS + 1)), "prompt"),
    (completion(prompt=[[5]] * 10_000), "prompt"), (completion(prompt=["a"] * MAX_PROMPTS, n=MAX_N + 1), "n"),
    # shapes
    (completion(prompt=[[[5]]]), "prompt"), (completion(prompt={"text": "x"}), "prompt"),
    (completion(echo=True), "echo"),
    # logit_bias: an id per key, in the vocabulary, with a bias in [-100, 100]
    (completion(logit_bias={str(i): 1 for i in range(100_000)}), "logit_bias"),
    (completion(logit_bias={"5": 1e308}), "logit_bias"), (completion(logit_bias={"1e3": 1}), "logit_bias"),
    (completion(logit_bias={"5": "1"}), "logit_bias"), (completion(logit_bias=[[5, 1]]), "logit_bias"),
]
HOSTILE_RAW = [  # NaN / Infinity are not JSON, but Python's parser takes them: they must not get through
    (raw(temperature="NaN"), "temperature"), (raw(top_p="NaN"), "top_p"), (raw(min_p="Infinity"), "min_p"),
    (raw(presence_penalty="-Infinity"), "presence_penalty"), (raw(frequency_penalty="NaN"), "frequency_penalty"),
    (raw(repetition_penalty="Infinity"), "repetition_penalty"), (raw(max_tokens="Infinity"), "max_tokens"),
    (raw(seed="NaN"), "seed"), (raw(top_k="1e400"), "top_k"), (raw(temperature="1e400"), "temperature"),
    (raw(n="-Infinity"), "n"),
]
HOSTILE_CHATS = [
    (chat(messages=[{"role": "tool"}]), "messages"),
    (chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), "messages"),
    (chat(messages=[{"content": "no role"}]), "messages"),
    (chat(messages=[{"role": None, "content": "x"}]), "messages"),
    (chat(messages=[{"role": "user"}]), "messages"),
    (chat(messages=[{"role": "user", "content": None}]), "messages"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages"),
    (chat(messages=[{"role": "user", "content": []}]), "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]),
     "messages"),
    (chat(messages=[{"role": "user", "content": "x", "name": 5}]), "messages"),
    (chat(messages={"role": "user", "content": "x"}), "messages"),
    (chat(messages=["hi"]), "messages"),
    (chat(messages=[[{"role": "user", "content": "x"}]]), "messages"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat(tool_choice="auto"), "tool_choice"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(function_call={"name": "f"}), "function_call"),
    (chat(response_format={"type": "json_schema"}), "response_format"),
    (chat(top_logprobs=5), "top_logprobs"),  # without logprobs: true
    (chat(logprobs=True, top_logprobs=HUGE), "top_logprobs"),
    (chat(max_completion_tokens=HUGE), "max_completion_tokens"),
    (chat(n=HUGE), "n"),
    (chat(max_completion_tokens=4, max_tokens=10_000), "max_tokens"),  # unused, but still bounded
    (chat(temperature=1e-300), "temperature"),
]


def _refused(r: httpx.Response, param: str | None, backend: FakeBackend, before: int) -> None:
    err = assert_error(r, 400, param)
    assert_no_internals(r.text)
    assert len(err["message"]) < 600
    assert not any(tag in err["message"] for tag in ("constrained-", "function-", "list[", "Value error"))
    assert len(backend.requests) == before  # refused at the edge: nothing reached the workers


@pytest.mark.parametrize(("body", "param"), HOSTILE_COMPLETIONS, ids=lambda x: json.dumps(x)[:70])
def test_hostile_completion_fields_are_400(http, backend, body, param):
    before = len(backend.requests)
    _refused(http.post("/v1/completions", json=body), param, backend, before)


@pytest.mark.parametrize(("content", "param"), HOSTILE_RAW, ids=lambda x: str(x)[-40:])
def test_nan_and_infinity_are_400(http, backend, content, param):
    before = len(backend.requests)
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    _refused(r, param, backend, before)


@pytest.mark.parametrize(("body", "param"), HOSTILE_CHATS, ids=lambda x: json.dumps(x)[:70])
def test_malformed_chat_fields_are_400(http, backend, body, param):
    before = len(backend.requests)
    _refused(http.post("/v1/chat/completions", json=body), param, backend, before)


@pytest.mark.parametrize("content", [
    b'{"model": "fake-model", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting bomb
    b'{"model": "fake-model", "prompt": "\xff\xfe"}',  # not UTF-8
    b'{"model": "fake-model", "prompt": "x", "prompt": 5}',  # the last duplicate key wins
    b'{"model": "fake-model", "prompt": "x", "top_k": ' + b"9" * 5000 + b"}",  # past Python's int digit limit
])
def test_malformed_json_is_400(http, backend, content):
    before = len(backend.requests)
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    _refused(r, "*", backend, before)


def test_too_large_is_413_and_the_server_still_serves(http, backend):
    r = http.post("/v1/completions", json=completion(prompt="x" * (LIMIT + 1)))
    assert_error(r, 413, code="request_too_large")
    assert_no_internals(r.text)
    ok = http.post("/v1/completions", json=completion(max_tokens=4, ignore_eos=True, top_p=1e-300,
                                                         min_tokens=10, stop=["z" * MAX_STOP_STRING_CHARS]))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4  # min_tokens capped at max_tokens
    assert not backend.running()


def test_the_server_answers_normally_after_the_hostile_suite(http, backend, tok):
    r = http.post("/v1/completions", json=completion(prompt=[5], max_tokens=6, ignore_eos=True, n=MAX_N, seed=1))
    assert r.status_code == 200
    want = [tok.decode(backend.tokens([5], SamplingParams(max_tokens=6, ignore_eos=True, seed=1 + i)))
            for i in range(MAX_N)]
    assert [c["text"] for c in r.json()["choices"]] == want
    assert not backend.running()


# ------------------------------------------------------------------ backend errors
def _ray_error(cause: Exception) -> Exception:
    """What ``ray.get`` raises for an exception inside an actor: an instance of both
    ``RayTaskError`` and the cause's class, whose text holds the remote traceback."""
    from ray.exceptions import RayTaskError

    trace = ("Traceback (most recent call last):\n  File \"/opt/tandem/services/tandem/engine/engine.py\", line 412, "
             "in step\n    probs = torch.topk(logits, k)\nRuntimeError: selected index k out of range")
    return RayTaskError("DecodeWorker.start", trace, cause, proctitle="ray::DecodeWorker.start()", pid=31337,
                        ip="10.42.7.19", actor_id="f" * 32).as_instanceof_cause()


LEAKY = [
    (lambda: _ray_error(ValueError("top_k 100000000000000000000 overflows int64 at /opt/x.py:3")), "rejected_by_worker"),
    (lambda: _ray_error(RuntimeError("CUDA error at /usr/lib/x.so")), "internal_error"),
    (lambda: NoWorkersError("no decode worker alive: actor 9f8e7d6c5b4a39281706f5e4d3c2b1a0 died on 10.0.0.5", 2),
     "no_workers"),
    (lambda: ClusterFullError("decode worker decode-0 (pid=4242, node 10.0.0.6) has no free blocks", 1),
     "cluster_full"),
    (lambda: PromptTooLargeError("needs 90 blocks; worker decode-1 at 192.168.1.4 has 64"), "prompt_too_large"),
    (lambda: WorkerLostError("decode-0", "decode worker decode-0 lost: ActorDiedError pid=77 ip=10.0.0.7"),
     "worker_failed"),
    (lambda: TransferError("gloo recv timed out on /tmp/ray/session_2026/sockets/raylet"), "worker_failed"),
    (lambda: OSError(24, "Too many open files: '/proc/self/fd/1023'"), "internal_error"),
]


@pytest.mark.parametrize(("make", "code"), LEAKY, ids=[c for _, c in LEAKY])
@pytest.mark.parametrize("when", ["before the first token", "mid-stream", "non-streaming"])
def test_backend_failures_reach_the_client_as_fixed_messages(tok, make, code, when):
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, fail=make(),
                       fail_after=3 if when == "mid-stream" else 0)
    stream = when != "non-streaming"
    status, message = BACKEND_ERRORS[code]
    with ServerThread(create_app(fake, tok)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=completion(stream=stream, max_tokens=8, ignore_eos=True),
                       timeout=20)
    if when == "mid-stream":
        assert r.status_code == 200
        frames = [f for f in r.text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        assert_no_internals(frames[-2])
        err = json.loads(frames[-2][len("data: "):])["error"]
    else:
        assert_no_internals(r.text)
        err = assert_error(r, status, code=code)
    assert err["message"] == message and err["code"] == code
    assert not fake.running()


def test_an_unexpected_gateway_error_is_a_fixed_500(tok):
    class Broken(Tokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise KeyError("/srv/models/llama/tokenizer_config.json: pid 1234 on 10.9.8.7")

    broken = Broken(tok.backend, special_tokens=tok.special_tokens_map, eos_token_ids=tok.eos_token_ids,
                    chat_template=tok.chat_template, byte_level=tok.is_byte_level)
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size)
    with ServerThread(create_app(fake, broken)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat(), timeout=20)
    err = assert_error(r, 500, code="internal_error")
    assert err["message"] == BACKEND_ERRORS["internal_error"][1]
    assert_no_internals(r.text)


# ------------------------------------------------------------------ tokenization
class _Gated:
    """A ``tokenizers.Tokenizer`` stand-in: records each ``encode_batch`` (text size and
    thread), and holds it until ``release`` is set when the text holds ``GATE``."""

    GATE = "gate: "

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls: list[tuple[int, int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls.append((sum(len(t) for t in texts), threading.get_ident()))
        if any(self.GATE in t for t in texts):
            self.entered.set()
            assert self.release.wait(30)
        return self._inner.encode_batch(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _SpyTokenizer(Tokenizer):
    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(tok.backend, special_tokens=tok.special_tokens_map, eos_token_ids=tok.eos_token_ids,
                         chat_template=tok.chat_template, byte_level=tok.is_byte_level)
        self.gated = _Gated(tok.backend)

    @property
    def backend(self):
        return self.gated


@pytest.fixture()
def spied(tok):
    spy = _SpyTokenizer(tok)
    fake = FakeBackend(model_id=MODEL, max_model_len=512, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)
    with ServerThread(create_app(fake, spy, max_body_bytes=8 << 20)) as srv:
        yield srv, spy, fake


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_text_too_long_for_the_context_is_refused_before_tokenizing(spied, path):
    srv, spy, fake = spied
    big = "The quick brown fox. " * 200_000  # 4.2 MB
    body = completion(prompt=big) if path == "/v1/completions" else chat(messages=[{"role": "user", "content": big}])
    r = httpx.post(srv.url + path, json=body, timeout=30)
    err = assert_error(r, 400, "prompt" if path == "/v1/completions" else "messages", "context_length_exceeded")
    assert "512" in err["message"]
    assert spy.gated.calls == [] and fake.requests == {}


def test_prompts_are_tokenized_off_the_event_loop_which_keeps_serving(spied, tok):
    srv, spy, fake = spied
    text = _Gated.GATE + "a prompt that takes its time"

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            slow = asyncio.create_task(c.post("/v1/completions", json=completion(prompt=text, max_tokens=3)))
            while not spy.gated.entered.is_set():  # the slow prompt is being tokenized
                await asyncio.sleep(0.01)
            quick = await c.post("/v1/chat/completions", json=chat(max_tokens=3, stream=True))  # served meanwhile
            assert not slow.done()
            spy.gated.release.set()
            return quick, await slow

    quick, slow = asyncio.run(main())
    assert quick.status_code == 200 and quick.text.endswith("data: [DONE]\n\n")
    assert slow.status_code == 200
    (prompt_ids,) = [q.prompt_token_ids for q in fake.requests.values() if q.request_id.startswith(slow.json()["id"])]
    assert prompt_ids == tok.encode(text)  # the same ids as Tokenizer.encode
