"""The real default model through the cluster in every mode, via the openai SDK: greedy
chat completions token-identical to transformers loading the same GGUF (fp32), and seeded
top-p samples token-identical to the offline engine's; the same for prompts of ~940 tokens."""

from __future__ import annotations

import pytest

from tandem.common.config import (CacheConfig, ClusterConfig, ClusterMode, EngineConfig,
                                    SchedulerConfig)
from tests.real_model import EOS, LONG_QUESTIONS, MAX_NEW, QUESTIONS, messages

pytestmark = pytest.mark.real_model

PREFILL_CHUNK = 256  # the per-step token budget: each long prompt is prefilled over several steps


@pytest.fixture(scope="module", params=list(ClusterMode))
def served(request, ray_session, real_model_dir, real_model_reference):
    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.engine.model.config import ModelConfig
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    mode = request.param
    engine = EngineConfig(model=str(real_model_dir), dtype="float32", cache=CacheConfig(num_blocks=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=PREFILL_CHUNK))
    # conditional: a threshold between the prompts' lengths, so both paths are taken
    lengths = sorted(len(p) for p in real_model_reference["prompts"])
    assert lengths[0] < lengths[-1]
    config = ClusterConfig(mode=mode, engine=engine, prefill_workers=0 if mode is ClusterMode.COLOCATED else 1,
                           local_prefill_threshold=lengths[len(lengths) // 2])
    cluster = Cluster(config).start()
    mc = ModelConfig.from_dir(real_model_dir)
    app = create_app(ClusterBackend(cluster, "smollm2", mc.max_position_embeddings, mc.vocab_size),
                     Tokenizer.from_dir(real_model_dir), request_timeout_s=300)
    try:
        with ServerThread(app) as server:
            yield server
    finally:
        cluster.shutdown()


def test_greedy_chat_through_the_cluster_matches_transformers(served, real_model_reference):
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    for question, prompt, expected in zip(QUESTIONS, real_model_reference["prompts"],
                                          real_model_reference["outputs"]):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages(question), max_tokens=MAX_NEW, temperature=0)
        assert reply.usage.prompt_tokens == len(prompt)
        text = real_model_reference["tokenizer"].decode(expected, skip_special_tokens=True)
        assert reply.choices[0].message.content == text, question
        assert reply.usage.completion_tokens == len(expected), question
        assert reply.choices[0].finish_reason == ("stop" if expected[-1] == EOS else "length")


SAMPLED = dict(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def sampled_reference(real_model_dir, real_model_reference):
    """The offline engine's seeded samples of each chat prompt (seed 11 + i)."""
    from tandem.engine import LLM, SamplingParams
    from tandem.engine.model.config import ModelConfig
    from tandem.engine.sampling_masks import CANDIDATES

    # a vocabulary beyond the candidates: top-p is decided among them, as in production
    assert ModelConfig.from_dir(real_model_dir).vocab_size > CANDIDATES
    llm = LLM(str(real_model_dir), dtype="float32")
    outs = [llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, seed=11 + i, **SAMPLED))[0]
            for i, prompt in enumerate(real_model_reference["prompts"])]
    return [list(o.outputs[0].token_ids) for o in outs]


def test_seeded_top_p_chat_through_the_cluster_matches_the_offline_engine(
        served, real_model_reference, sampled_reference):
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    greedy = real_model_reference["outputs"]
    assert any(s != g for s, g in zip(sampled_reference, greedy))  # it sampled
    for i, (question, expected) in enumerate(zip(QUESTIONS, sampled_reference)):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages(question), max_tokens=MAX_NEW, seed=11 + i, **SAMPLED)
        text = real_model_reference["tokenizer"].decode(expected, skip_special_tokens=True)
        assert reply.choices[0].message.content == text, question
        assert reply.usage.completion_tokens == len(expected), question


@pytest.fixture(scope="module")
def long_reference(real_model_dir, real_model_reference):
    """The long prompts' expected outputs: transformers' greedy ones, which the offline engine
    prefilling in PREFILL_CHUNK-token chunks (as the cluster does) must match too, and the
    offline engine's seeded top-p output of the second prompt."""
    from tandem.engine import LLM, SamplingParams

    prompts, greedy = real_model_reference["long_prompts"], real_model_reference["long_outputs"]
    assert all(len(p) > 3 * PREFILL_CHUNK for p in prompts)
    # no prompt reuses another's cached blocks, as none does in the cluster (they share no prefix)
    llm = LLM(str(real_model_dir), dtype="float32", max_num_batched_tokens=PREFILL_CHUNK,
              enable_prefix_caching=False)
    offline = [list(o.outputs[0].token_ids) for o in
               llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))]
    assert offline == greedy  # chunked prefill and key-chunked attention, checked independently
    sampled = llm.generate([prompts[1]], SamplingParams(max_tokens=MAX_NEW, seed=5, **SAMPLED))[0]
    sampled = list(sampled.outputs[0].token_ids)
    assert sampled != greedy[1]  # it sampled
    return {"prompts": prompts, "greedy": greedy, "sampled": sampled}


def test_long_prompts_through_the_cluster_match_the_references(
        served, real_model_reference, long_reference):
    """Prompts of several prefill chunks and decode-attention key chunks, one per request (no
    prefix-cache hits): greedy and streamed match transformers, seeded top-p the offline
    engine, in every mode."""
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    decode = real_model_reference["tokenizer"].decode
    prompts, greedy = long_reference["prompts"], long_reference["greedy"]
    for i, params, expected in ((0, dict(temperature=0), greedy[0]),
                                (1, dict(seed=5, **SAMPLED), long_reference["sampled"])):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages(LONG_QUESTIONS[i]), max_tokens=MAX_NEW, **params)
        assert reply.usage.prompt_tokens == len(prompts[i])
        assert reply.choices[0].message.content == decode(expected, skip_special_tokens=True), params
        assert reply.usage.completion_tokens == len(expected)
    stream = client.chat.completions.create(
        model="smollm2", messages=messages(LONG_QUESTIONS[2]), max_tokens=MAX_NEW, temperature=0,
        stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == decode(greedy[2], skip_special_tokens=True)
