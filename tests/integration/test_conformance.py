"""The whole sampling and output API on the real cluster, in every mode, exactly as offline.

Real Ray actors (gloo KV transfer, one layer per group), a real uvicorn gateway and the
real ``openai`` client. Every request's choices (text, token count, finish reason,
logprobs) must equal what the offline ``LLM`` gives for the same parameters, streamed
and not, in ``disaggregated``, ``colocated`` and ``conditional`` mode, and when a decode
worker is killed while the streams run (the requests are re-driven mid-stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.hf_models import VOCAB
from tests.integration.test_cluster import _config, wait_all_free

MODEL = "tiny"
CONTEXT = 512  # the test checkpoint's max_position_embeddings
MODES = {
    "disaggregated": dict(prefill_workers=1, decode_workers=1),
    "colocated": dict(mode="colocated", prefill_workers=0, decode_workers=2),
    "conditional": dict(mode="conditional", prefill_workers=1, decode_workers=1,
                        local_prefill_threshold=12),
}
# vLLM's extra sampling fields travel in extra_body; OpenAI's are keyword arguments.
EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
          "include_stop_str_in_output", "stop_token_ids")


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str | list[int] | list[dict]  # a chat when a list of messages
    params: SamplingParams

    @property
    def chat(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)


def _greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def offline(checkpoint) -> LLM:
    return LLM(checkpoint)


@pytest.fixture(scope="module")
def cases(offline) -> list[Case]:
    """Cases whose stop strings are cut from the model's own greedy text (so they hit)."""
    base = "The quick brown fox"
    greedy = offline.generate([base], _greedy(24))[0].outputs[0]
    text = greedy.text
    across = text[3:9]  # six characters: spans token boundaries
    rng = random.Random(5)
    out = [
        Case("greedy", base, _greedy()),
        Case("stop-across-tokens", base, _greedy(24, stop=[across])),
        Case("stop-included", base, _greedy(24, stop=["never-there", across],
                                            include_stop_str_in_output=True)),
        Case("min-tokens-delays-stop", base, _greedy(24, stop=[text[:2]], min_tokens=6)),
        # the very first token is a stop token: the prefill worker's token ends the request
        Case("stop-token-first", base, _greedy(24, stop_token_ids=[greedy.token_ids[0]])),
        Case("stop-token-third", base, _greedy(24, stop_token_ids=[greedy.token_ids[2]])),
        Case("one-token", base, _greedy(1)),
        Case("seed", "Once upon a time", SamplingParams(temperature=1.0, seed=123, max_tokens=20)),
        Case("seed-masks", "Once upon a time",
             SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=7, max_tokens=20)),
        Case("n-with-seed", "def fibonacci(n):", SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)),
        Case("penalties", "1, 2, 3,", SamplingParams(temperature=0.7, seed=5, max_tokens=20,
                                                      presence_penalty=1.5, frequency_penalty=1.0,
                                                      repetition_penalty=1.3)),
        # logit_bias: the same ids steer the prefill worker's token #1 and every decode step
        Case("logit-bias", base, _greedy(16, logit_bias={greedy.token_ids[1]: -100.0, greedy.token_ids[5]: 4.0})),
        Case("logit-bias-seeded", "Once upon a time",
             SamplingParams(temperature=1.0, seed=21, max_tokens=16, logprobs=1,
                            logit_bias={t: -100.0 for t in greedy.token_ids[:6]})),
        Case("logprobs", base, _greedy(8, logprobs=3)),
        Case("seed-logprobs", base, SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=2)),
        Case("context-limit", [rng.randrange(2, VOCAB) for _ in range(CONTEXT - 9)], _greedy(9)),
        Case("token-ids", [rng.randrange(2, VOCAB) for _ in range(30)], _greedy(12, stop=[across])),
        Case("chat", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
             _greedy(12)),
        Case("chat-seed-logprobs", [{"role": "user", "content": "Tell me a story."}],
             SamplingParams(temperature=1.0, seed=9, max_tokens=12, logprobs=2)),
    ]
    # Multi-byte stop strings: one that never matches (held-back text must come out whole),
    # and one cut from the output where it has a real multi-byte character.
    out.append(Case("stop-multibyte-never", base, _greedy(24, stop=["日本", "é"])))
    multibyte = next((c for c in text if ord(c) > 127 and c != "\ufffd"), None)
    if multibyte is not None:
        out.append(Case("stop-multibyte", base, _greedy(24, stop=[multibyte])))
    return out


def expected(offline: LLM, case: Case) -> list[dict]:
    run = offline.chat if case.chat else offline.generate
    outs = run([case.prompt], case.params)[0].outputs
    return [{"text": o.text, "tokens": len(o.token_ids), "finish_reason": o.finish_reason.value,
             "logprobs": [lp.logprob for lp in o.logprobs] if o.logprobs is not None else None}
            for o in outs]


def request_kwargs(case: Case) -> dict:
    p = case.params
    kw = dict(model=MODEL, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, n=p.n,
              seed=p.seed, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
              stop=list(p.stop) or None)
    if p.logit_bias:
        kw["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    if p.logprobs is not None:
        kw.update(logprobs=True, top_logprobs=p.logprobs) if case.chat else kw.update(logprobs=p.logprobs)
    extra = {k: getattr(p, k) for k in EXTRAS if getattr(p, k) != getattr(SamplingParams(), k)}
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in extra.items()}
    kw["extra_body"] = extra
    kw["messages" if case.chat else "prompt"] = case.prompt
    return {k: v for k, v in kw.items() if v is not None}


def _choice_logprobs(choice, chat: bool) -> list[float] | None:
    if choice.logprobs is None:
        return None
    if chat:
        return [e.logprob for e in choice.logprobs.content]
    return list(choice.logprobs.token_logprobs)


def ask(client, case: Case) -> tuple[list[dict], int]:
    """The choices of one non-streamed request (shaped as :func:`expected`) and its token count."""
    api = client.chat.completions if case.chat else client.completions
    resp = api.create(**request_kwargs(case))
    choices = sorted(resp.choices, key=lambda c: c.index)
    texts = [c.message.content if case.chat else c.text for c in choices]
    return [{"text": t, "finish_reason": c.finish_reason, "logprobs": _choice_logprobs(c, case.chat)}
            for t, c in zip(texts, choices)], resp.usage.completion_tokens


async def ask_streamed(client, case: Case, on_chunk=None) -> tuple[list[dict], int]:
    """The choices of one streamed request, concatenated per index, and its token count."""
    api = client.chat.completions if case.chat else client.completions
    stream = await api.create(stream=True, stream_options={"include_usage": True}, **request_kwargs(case))
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    lps: dict[int, list[float]] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            part = (c.delta.content if case.chat else c.text) or ""
            texts.setdefault(c.index, []).append(part)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
            got = _choice_logprobs(c, case.chat)
            if got:
                lps.setdefault(c.index, []).extend(got)
        if on_chunk is not None:
            await on_chunk()
    return [{"text": "".join(texts[i]), "finish_reason": reasons[i],
             "logprobs": lps.get(i) if case.params.logprobs is not None else None}
            for i in sorted(texts)], usage.completion_tokens


def assert_same(case: Case, want: list[dict], got: list[dict], completion_tokens: int) -> None:
    assert len(got) == len(want), case.name
    assert completion_tokens == sum(w["tokens"] for w in want), case.name
    for i, (w, g) in enumerate(zip(want, got)):
        assert g["text"] == w["text"], (case.name, i)
        assert g["finish_reason"] == w["finish_reason"], (case.name, i)
        if w["logprobs"] is not None:
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-3), (case.name, i)


@pytest.fixture(scope="module", params=sorted(MODES))
def served(request, ray_session, checkpoint):
    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    cluster = Cluster(_config(checkpoint, layer_group_size=1, **MODES[request.param])).start()
    backend = ClusterBackend(cluster, MODEL, CONTEXT, VOCAB)
    app = create_app(backend, Tokenizer.from_dir(checkpoint), request_timeout_s=120)
    try:
        with ServerThread(app) as server:
            yield server, cluster
    finally:
        cluster.shutdown()


def test_every_field_equals_offline(served, offline, cases):
    import openai

    server, cluster = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def streamed(case: Case):
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            return await ask_streamed(c, case)
    for case in cases:
        want = expected(offline, case)
        got, used = ask(client, case)
        assert_same(case, want, got, used)
        got, used = asyncio.run(streamed(case))
        assert_same(case, want, got, used)
    stats = wait_all_free(cluster, timeout_s=20)
    assert all(s["free_blocks"] == s["total_blocks"] and s["held"] == 0 for s in stats), stats


def test_streams_survive_a_decode_worker_kill(ray_session, checkpoint, offline, cases):
    """Every n == 1 case streamed at once on 1P+2D; one decode worker is killed once half
    the streams are under way: every answer still equals the offline one."""
    import openai
    import ray

    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    chosen = [c for c in cases if c.params.n == 1 and c.name != "context-limit"]
    chosen = [dataclasses.replace(c, params=dataclasses.replace(c.params, max_tokens=max(24, c.params.max_tokens)))
              if c.params.temperature > 0 else c for c in chosen]
    cluster = Cluster(_config(checkpoint, layer_group_size=1, prefill_workers=1, decode_workers=2)).start()
    backend = ClusterBackend(cluster, MODEL, CONTEXT, VOCAB)
    app = create_app(backend, Tokenizer.from_dir(checkpoint), request_timeout_s=120)
    try:
        with ServerThread(app) as server:
            chunks = [0] * len(chosen)
            killed = []

            def counter(i: int):
                async def on_chunk() -> None:
                    chunks[i] += 1
                    if not killed and sum(n >= 3 for n in chunks) >= len(chosen) // 2:
                        killed.append(cluster.decode[0].worker_id)
                        ray.kill(cluster.decode[0].actor, no_restart=True)
                    await asyncio.sleep(0.01)  # let the kill land while streams run
                return on_chunk

            async def main():
                async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                              max_retries=0) as aclient:
                    return await asyncio.gather(*(ask_streamed(aclient, c, counter(i))
                                                  for i, c in enumerate(chosen)))
            results = asyncio.run(main())
            assert killed
            for case, (got, used) in zip(chosen, results):
                assert_same(case, expected(offline, case), got, used)
    finally:
        cluster.shutdown()
