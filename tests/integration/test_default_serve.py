"""``tandem serve`` with no model: the embedded SmolLM2-135M-Instruct answers a real question
through the openai SDK, under its own name."""

from __future__ import annotations

import sys

import pytest

from services.bench.launcher import TandemServer

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_server(real_model_dir):
    """``python -m services.cluster.cli serve --port P``: nothing else (the model is converted
    into the shared cache by the fixture first, so start-up does not count conversion)."""
    server = TandemServer("unused", startup_timeout_s=600)
    server.argv = [sys.executable, "-m", "services.cluster.cli", "serve", "--port", str(server.port)]
    with server:
        yield server


def test_serve_without_arguments_answers_with_the_default_model(default_server):
    import openai

    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused")
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
