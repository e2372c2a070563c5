"""Hostile input against the real thing: uvicorn, the gateway and a Ray cluster (1 prefill +
1 decode worker) in each mode: disaggregated, colocated, conditional. Out-of-range requests are refused at the edge with 400/413
and nothing of the server's insides; requests at the very edge of every bound are served;
afterwards no worker was replaced or restarted and the next request gets the same tokens
as before the suite."""

from __future__ import annotations

import json

import httpx
import pytest

from tandem.common.sampling_params import (MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                                             MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                             MIN_REPETITION_PENALTY, MIN_TEMPERATURE)
from tandem.gateway.schemas import MAX_JSON_SEED
from tests.gateway_helpers import assert_error, assert_no_internals
from tests.integration.test_cluster import MODES, _config

MODEL, MAX_N, MAX_PROMPTS, LIMIT = "tiny", 4, 8, 1 << 20


@pytest.fixture(scope="module", params=["1P1D", "colocated", "conditional"])
def served(request, ray_session, checkpoint):
    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.engine.model.config import ModelConfig
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    cluster = Cluster(_config(checkpoint, **MODES[request.param])).start()
    mc = ModelConfig.from_dir(checkpoint)
    backend = ClusterBackend(cluster, MODEL, mc.max_position_embeddings, mc.vocab_size)
    app = create_app(backend, Tokenizer.from_dir(checkpoint), request_timeout_s=120, max_n=MAX_N,
                     max_prompts=MAX_PROMPTS, max_body_bytes=LIMIT)
    try:
        with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=120) as http:
            yield http, cluster, backend
    finally:
        cluster.shutdown()


def _workers(cluster) -> list[tuple[str, str]]:
    """Each worker's id and its actor's id (a replaced worker gets a new actor)."""
    return [(w.worker_id, w.actor._actor_id.hex()) for w in cluster.prefill + cluster.decode]


GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def completion(**kw) -> dict:
    return {**GREEDY, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def raw(field: str, value: str) -> str:
    return json.dumps(GREEDY)[:-1] + f', "{field}": {value}' + "}"


HUGE = 10**20
REFUSED = [  # (path, body or raw JSON text, param)
    ("/v1/completions", completion(top_k=HUGE), "top_k"),  # issue 11: killed the engine loop
    ("/v1/completions", completion(top_k=100_000), "top_k"),  # beyond the vocabulary
    ("/v1/completions", completion(max_tokens=HUGE), "max_tokens"),
    ("/v1/completions", completion(n=-1), "n"),
    ("/v1/completions", completion(seed=2**64), "seed"),
    ("/v1/completions", raw("temperature", "NaN"), "temperature"),
    ("/v1/completions", raw("top_p", "Infinity"), "top_p"),
    ("/v1/completions", completion(presence_penalty=1e308), "presence_penalty"),
    ("/v1/completions", completion(repetition_penalty=1e308), "repetition_penalty"),
    ("/v1/completions", completion(temperature=1e-300), "temperature"),
    ("/v1/completions", completion(repetition_penalty=1e-300), "repetition_penalty"),
    ("/v1/completions", completion(stop=["x"] * 10_000), "stop"),
    ("/v1/completions", completion(stop_token_ids=[10**9]), "stop_token_ids"),
    ("/v1/completions", completion(prompt=["p"] * (MAX_PROMPTS + 1)), "prompt"),
    ("/v1/completions", completion(n=MAX_N + 1), "n"),
    ("/v1/completions", completion(prompt=[10**6]), "prompt"),
    ("/v1/completions", completion(prompt=[2] * 100_000), "prompt"),  # beyond the context
    ("/v1/completions", completion(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    ("/v1/chat/completions", chat(messages=[{"role": "tool"}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": None}]), "messages"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("/v1/chat/completions", chat(top_logprobs=3), "top_logprobs"),
]
# At the very edge of every bound: served, and the workers live on.
EDGES = [
    completion(top_k=1), completion(temperature=MIN_TEMPERATURE, seed=MAX_JSON_SEED),
    completion(temperature=2, top_p=1e-300, seed=0), completion(min_p=1, temperature=1, seed=3),
    completion(presence_penalty=MAX_PENALTY, frequency_penalty=-MAX_PENALTY, repetition_penalty=MAX_REPETITION_PENALTY),
    completion(repetition_penalty=MIN_REPETITION_PENALTY, presence_penalty=-MAX_PENALTY),
    completion(stop_token_ids=[0] * MAX_STOP_TOKEN_IDS),
    completion(logprobs=MAX_LOGPROBS, min_tokens=10**9), completion(n=MAX_N, seed=MAX_JSON_SEED, temperature=1),
    completion(prompt=["a"] * MAX_PROMPTS, max_tokens=2),
]


def test_hostile_requests_are_refused_and_edge_requests_served_by_the_same_workers(served):
    http, cluster, backend = served
    workers, replaced = _workers(cluster), cluster.replacements
    before = http.post("/v1/completions", json=GREEDY)
    assert before.status_code == 200

    for path, body, param in REFUSED:
        r = (http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, str)
             else http.post(path, json=body))
        assert_error(r, 400, param)
        assert_no_internals(r.text)
    r = http.post("/v1/completions", json=completion(prompt="x" * (LIMIT + 1)))
    assert_error(r, 413, code="request_too_large")
    assert_no_internals(r.text)

    for body in EDGES + [completion(top_k=backend.vocab_size, temperature=1, seed=5)]:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, (body, r.text[:300])
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] in ("stop", "length")

    # the most and the longest stop strings allowed are served (the gateway owns them)
    r = http.post("/v1/completions", json=completion(stop=["\u2028" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS))
    assert r.status_code == 200, r.text[:300]

    after = http.post("/v1/completions", json=GREEDY)
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert _workers(cluster) == workers and cluster.replacements == replaced
    assert http.get("/ready").status_code == 200


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_on_the_cluster(served, mode):
    """Every check, positive data acceptance included, against the schema the cluster's gateway
    serves (its model's context and vocabulary in it); the workers live on."""
    schemathesis = pytest.importorskip("schemathesis")
    from tests.integration.test_gateway_schema import fuzz

    http, cluster, _ = served
    workers = _workers(cluster)
    schema = schemathesis.openapi.from_url(str(http.base_url) + "/openapi.json")
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert fuzz(schema, "POST", path, mode, 15)
    assert _workers(cluster) == workers and http.get("/ready").status_code == 200
