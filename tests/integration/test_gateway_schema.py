"""schemathesis against the gateway's OpenAPI document: no 5xx, every response as declared.

Drives schemathesis's hypothesis strategies directly (its pytest plugin's lazy loader
does not run on this pytest), against a real server, with valid and invalid data, and
every check, ``positive_data_acceptance`` included: what the schema allows is served,
what it forbids is refused. One exemption, documented in the schema's descriptions: a
prompt plus ``max_tokens`` beyond the context is refused (400
``context_length_exceeded``), a bound in tokens that no JSON Schema of a text field can
state.
"""

from __future__ import annotations

import re

import pytest

from tandem.gateway import ServerThread, create_app
from tests.fake_backend import FakeBackend
from tandem.text.tokenizer import Tokenizer

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

MODEL = "fake-model"
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}"), ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def api(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    fake = FakeBackend(model_id=MODEL, max_model_len=64, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)
    with ServerThread(create_app(fake, tok, max_n=4, max_prompts=8, request_timeout_s=120)) as srv:
        yield schemathesis.openapi.from_url(srv.url + "/openapi.json"), fake


def test_every_route_is_covered(api):
    schema, _ = api
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert found == set(OPERATIONS)


def _context_length_exceeded(response) -> bool:
    if response.status_code != 400:
        return False
    return response.json()["error"]["code"] == "context_length_exceeded"


CASES = [(m, p, mode) for m, p in OPERATIONS for mode in ("positive", "negative")
         if mode == "positive" or m == "POST"]  # the GETs take nothing that could be invalid


def fuzz(schema, method: str, path: str, mode: str, examples: int) -> set[int]:
    """Send ``examples`` generated requests (``mode``: positive or negative) and run every
    check on each answer; return the statuses seen."""
    op = schema[path][method]
    statuses: set[int] = set()

    @hypothesis.given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case):
        response = case.call(timeout=300)
        statuses.add(response.status_code)
        if not (mode == "positive" and _context_length_exceeded(response)):
            case.validate_response(response, additional_checks=[schemathesis.checks.positive_data_acceptance])
        assert response.status_code < 500

    check()
    return statuses


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=lambda x: x)
def test_responses_conform_and_are_never_5xx(api, method, path, mode):
    schema, fake = api
    statuses = fuzz(schema, method, path, mode, 40 if method == "POST" else 10)
    assert statuses
    assert not fake.running()


def _walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_the_schema_states_what_is_accepted(api, tiny_model_dir):
    schema, _ = api
    doc = schema.raw_schema
    comps = doc["components"]["schemas"]
    chat, comp = comps["ChatCompletionRequest"], comps["CompletionRequest"]
    for name in ("tools", "tool_choice", "functions", "function_call"):  # unsupported: not offered
        assert name not in chat["properties"]
    assert not any("x-limit" in node for node in _walk(doc))  # every marker became a bound
    shapes = comp["properties"]["prompt"]["anyOf"]
    assert shapes[0] == {"type": "string", "minLength": 1}
    assert all(s["minItems"] == 1 for s in shapes[1:])
    assert shapes[1]["maxItems"] == 8 and shapes[2]["maxItems"] == 63  # max_prompts; context - 1
    assert shapes[2]["items"]["maximum"] == Tokenizer.from_dir(tiny_model_dir).vocab_size - 1

    def bound(props, name):
        (branch,) = [b for b in props[name]["anyOf"] if b.get("type") == "integer"]
        return branch["maximum"]

    assert bound(comp["properties"], "n") == 4 and bound(comp["properties"], "max_tokens") == 63
    assert bound(chat["properties"], "max_completion_tokens") == 63
    assert bound(comp["properties"], "top_k") == Tokenizer.from_dir(tiny_model_dir).vocab_size
    (bias,) = [b for b in chat["properties"]["logit_bias"]["anyOf"] if b.get("type") == "object"]
    keys = re.compile(bias["propertyNames"]["pattern"])  # token ids of the vocabulary, no other spelling
    vocab = Tokenizer.from_dir(tiny_model_dir).vocab_size
    assert [k for k in range(vocab + 100) if keys.match(str(k))] == list(range(vocab))
    assert not any(keys.match(k) for k in ("01", "-1", "1.0", "", "1e3"))
    assert bias["maxProperties"] == 1024
    roles = {}
    for ref in chat["properties"]["messages"]["items"]["oneOf"]:
        message = comps[ref["$ref"].rsplit("/", 1)[1]]
        roles[message["properties"]["role"]["const"]] = message
    assert set(roles) == {"system", "developer", "user", "assistant"}  # no tool / function messages
    assert all(set(m["required"]) == {"role", "content"} for m in roles.values())
    assert chat["then"]["required"] == ["logprobs"]  # top_logprobs needs logprobs: true
