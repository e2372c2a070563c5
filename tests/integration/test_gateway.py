"""The gateway through the real ``openai`` SDK, against a real uvicorn server and a fake backend."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.gateway import ServerThread, create_app
from tests.fake_backend import FakeBackend
from tandem.text.tokenizer import Tokenizer

MODEL = "fake-model"


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def backend(tok) -> FakeBackend:
    return FakeBackend(model_id=MODEL, max_model_len=256, vocab_size=tok.vocab_size,
                       eos_token_ids=tok.eos_token_ids)


@pytest.fixture(scope="module")
def server(backend, tok):
    with ServerThread(create_app(backend, tok, request_timeout_s=30)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def expected(backend: FakeBackend, tok: Tokenizer, prompt_ids: list[int], **params) -> tuple[str, list[int], str]:
    """(text, tokens, finish_reason) the gateway should produce from the fake's output."""
    p = SamplingParams(**params)
    toks = backend.tokens(prompt_ids, p)
    reason = backend.finish_reason(prompt_ids, p, toks)
    visible = toks[:-1] if reason is FinishReason.STOP else toks
    return tok.decode(visible), toks, reason.value


def chat_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion_matches_the_backend_output(client, backend, tok):
    text, toks, reason = expected(backend, tok, tok.encode("Hello world"), max_tokens=12)
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(tok.encode("Hello world"))
    assert r.usage.completion_tokens == len(toks)
    assert r.usage.total_tokens == r.usage.prompt_tokens + len(toks)


def test_default_max_tokens_is_16_for_completions(client, backend, tok):
    _, toks, _ = expected(backend, tok, [5], max_tokens=16, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=[5], extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == len(toks) == 16 and r.choices[0].finish_reason == "length"


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="The quick model", max_tokens=20, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_prompt_shapes_and_batches(client, backend, tok):
    a, b = tok.encode("alpha"), tok.encode("beta gamma")
    r = client.completions.create(model=MODEL, prompt=["alpha", "beta gamma"], max_tokens=5, n=2, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, (ids, c) in enumerate(zip([a, a, b, b], r.choices)):
        assert c.text == expected(backend, tok, ids, max_tokens=5, seed=3 + i % 2)[0]
    assert r.usage.prompt_tokens == len(a) + len(b)
    r2 = client.completions.create(model=MODEL, prompt=[a, b], max_tokens=5, n=2, seed=3)
    assert [c.text for c in r2.choices] == [c.text for c in r.choices]
    r3 = client.completions.create(model=MODEL, prompt=a, max_tokens=5)
    assert r3.choices[0].text == expected(backend, tok, a, max_tokens=5)[0]


def test_chat_non_stream_and_default_max_tokens(client, backend, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = chat_ids(tok, msgs)
    text, toks, reason = expected(backend, tok, ids, max_tokens=256 - len(ids), ignore_eos=True)
    r = client.chat.completions.create(model=MODEL, messages=msgs, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == text
    assert c.finish_reason == "length" == reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 256 - len(ids)


def test_chat_content_parts_and_max_completion_tokens(client, backend, tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    ids = chat_ids(tok, [{"role": "user", "content": "one\ntwo"}])
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=7, max_tokens=3)
    assert r.choices[0].message.content == expected(backend, tok, ids, max_tokens=7)[0]


def test_chat_stream_async_with_usage_and_n(server, backend, tok):
    msgs = [{"role": "user", "content": "Tell me about the river"}]
    ids = chat_ids(tok, msgs)

    async def run():
        async with aclient(server) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, n=3, seed=11,
                                                     stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    texts, finish, roles = {}, {}, set()
    for ch in chunks[:-1]:
        assert ch.object == "chat.completion.chunk" and ch.usage is None
        (choice,) = ch.choices
        if choice.delta.role:
            roles.add(choice.index)
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2}
    want = [expected(backend, tok, ids, max_tokens=9, seed=11 + i) for i in range(3)]
    assert texts == {i: w[0] for i, w in enumerate(want)}
    assert finish == {i: w[2] for i, w in enumerate(want)}
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == sum(len(w[1]) for w in want)


def test_async_completion_non_stream_and_stream(server, backend, tok):
    async def run():
        async with aclient(server) as c:
            r = await c.completions.create(model=MODEL, prompt="async", max_tokens=6)
            s = await c.completions.create(model=MODEL, prompt="async", max_tokens=6, stream=True,
                                           stream_options={"include_usage": True})
            return r, [x async for x in s]

    r, chunks = asyncio.run(run())
    assert r.choices[0].text == expected(backend, tok, tok.encode("async"), max_tokens=6)[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_completion_logprobs(client, backend, tok):
    r = client.completions.create(model=MODEL, prompt="log", max_tokens=6, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    _, toks, _ = expected(backend, tok, tok.encode("log"), max_tokens=6, ignore_eos=True)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.token_logprobs == [backend.logprob(t, 2).logprob for t in toks]
    assert all(1 <= len(top) <= 3 and tokn in top for top, tokn in zip(lp.top_logprobs, lp.tokens))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model=MODEL, prompt="log", max_tokens=6, logprobs=2, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_chat_logprobs(client, backend, tok):
    msgs = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    _, toks, _ = expected(backend, tok, chat_ids(tok, msgs), max_tokens=5, ignore_eos=True)
    assert [e.logprob for e in content] == [backend.logprob(t, 3).logprob for t in toks]
    assert all(len(e.top_logprobs) == 3 and e.bytes is not None for e in content)
    assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == tok.decode(toks)
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
    assert r2.choices[0].logprobs is None


def _boundary_stop(tok: Tokenizer, toks: list[int]) -> tuple[str, int]:
    """A 2-character stop string across a token boundary, and where it first occurs."""
    full = tok.decode(toks)
    for j in range(1, len(toks) - 3):
        head, nxt = tok.decode(toks[:j + 1]), tok.decode([toks[j + 1]])
        b = len(head)
        if full.startswith(head) and tok.decode([toks[j]]) and nxt and full[b:].startswith(nxt):
            stop = full[b - 1:b + 1]
            if full.find(stop) == b - 1 and stop.isprintable():
                return stop, b - 1
    raise AssertionError("no usable token boundary in this output")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_token_boundary_aborts_the_request(client, backend, tok, stream):
    prompt = tok.encode("Stop here please")
    full, toks, _ = expected(backend, tok, prompt, max_tokens=40, ignore_eos=True)
    stop, at = _boundary_stop(tok, toks)
    before = set(backend.requests)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, stop=[stop, "never-seen"], extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[:at] and finish == "stop"
    (rid,) = set(backend.requests) - before
    assert backend.requests[rid].aborted  # the gateway closed the stream: the request is aborted
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop=stop,
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == full[:at + len(stop)]


def test_stop_token_ids_hide_the_stop_token(client, backend, tok):
    prompt = tok.encode("tokens")
    _, toks, _ = expected(backend, tok, prompt, max_tokens=10, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [toks[4]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == tok.decode(toks[:toks.index(toks[4])])
    assert r.usage.completion_tokens == toks.index(toks[4]) + 1


def test_multibyte_text_is_never_split(tok):
    text = "日本語のテキスト 🎉🚀✨ crème brûlée"
    script = [t for ch in text for t in tok.encode(ch)]  # per-character pieces, often partial UTF-8
    fake = FakeBackend(model_id=MODEL, vocab_size=tok.vocab_size, script=script)
    with ServerThread(create_app(fake, tok)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        chunks = list(c.completions.create(model=MODEL, prompt="x", max_tokens=len(script), stream=True))
    pieces = [ch.choices[0].text for ch in chunks]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 1
