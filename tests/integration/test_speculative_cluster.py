"""Speculative decoding in the decode pool of a real disaggregated cluster (Ray actors,
gloo KV transfer, uvicorn gateway, the openai SDK): outputs token-identical to the
offline engine without speculation, the draft counters exported by the decode worker
only, every block free afterwards."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest

from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig, SpeculativeConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.hf_models import VOCAB
from tests.integration.test_cluster import run_all, wait_all_free

PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=24, ignore_eos=True,
                         frequency_penalty=0.3, logit_bias={7: 2.0, 11: -100.0})]


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    units = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 7, 11)]
    return [u * (40 // len(u)) for u in units] + [[rng.randrange(2, VOCAB) for _ in range(30)]]


def _spec_samples(families, name: str) -> dict[str, float]:
    return {s.labels["role"]: s.value for f in families for s in f.samples if s.name == name}


@pytest.fixture(scope="module")
def served(ray_session, checkpoint):
    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.engine.model.config import ModelConfig
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    # 1-grams and a fixed k: a random model's output matches its prompt often enough
    # that the decode worker verifies drafts on most steps, accepted or not.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1,
                             adaptive=False, max_batch_size=64)
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=128), speculative=spec)
    cluster = Cluster(ClusterConfig(engine=engine, prefill_workers=1, decode_workers=1)).start()
    mc = ModelConfig.from_dir(checkpoint)
    backend = ClusterBackend(cluster, "tiny", mc.max_position_embeddings, mc.vocab_size)
    app = create_app(backend, Tokenizer.from_dir(checkpoint), request_timeout_s=120)
    with ServerThread(app) as server:
        yield server, cluster
    cluster.shutdown()


def test_disaggregated_outputs_match_offline_engine(served, checkpoint):
    _, cluster = served
    prompts = _prompts()
    llm = LLM(checkpoint)
    for params in PARAMS:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert run_all(cluster, prompts, params) == reference
    for s in wait_all_free(cluster):
        assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
    families = asyncio.run(cluster.worker_metric_families())
    proposed = _spec_samples(families, "tandem_spec_proposed_tokens_total")
    accepted = _spec_samples(families, "tandem_spec_accepted_tokens_total")
    assert proposed["decode"] > 0 and proposed.get("prefill", 0) == 0
    assert 0 <= accepted["decode"] <= proposed["decode"]
    assert _spec_samples(families, "tandem_spec_acceptance_length_count")["decode"] > 0


def test_openai_sdk_streams_the_offline_text(served, checkpoint):
    """Seeded and greedy requests through uvicorn: the text and logprobs of the engine
    without speculation; /metrics shows the drafts."""
    import openai

    server, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    llm = LLM(checkpoint)
    prompt = "one two three one two three one two three one two"
    for kw in (dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=17)):
        params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1,
                                temperature=kw["temperature"], top_p=kw.get("top_p", 1.0),
                                seed=kw.get("seed"))
        ref = llm.generate([prompt], params)[0].outputs[0]
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, stream=True,
                                           logprobs=1, extra_body={"ignore_eos": True}, **kw)
        chunks = [c.choices[0] for c in stream if c.choices]
        assert "".join(c.text for c in chunks) == ref.text
        got = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
        assert got == pytest.approx([lp.logprob for lp in ref.logprobs], abs=2e-4)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(r'^tandem_spec_proposed_tokens_total\{[^}]*role="decode"[^}]*\} (\S+)$', text,
                  re.MULTILINE)
    assert m is not None and float(m.group(1)) > 0


def test_draft_model_in_the_decode_pool(ray_session, checkpoint):
    """The decode worker prefills the imported prompt into its draft cache itself; the
    target drafting for itself is always right, and the output is the offline one."""
    from tandem.cluster.cluster import Cluster

    prompts = _prompts()
    reference = [o.outputs[0].token_ids for o in LLM(checkpoint).generate(prompts, PARAMS[0])]
    spec = SpeculativeConfig(method="draft", draft_model=checkpoint, num_speculative_tokens=3,
                             adaptive=False, max_batch_size=64)
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=128), speculative=spec)
    cluster = Cluster(ClusterConfig(engine=engine, prefill_workers=1, decode_workers=1)).start()
    try:
        assert run_all(cluster, prompts, PARAMS[0]) == reference
        for s in wait_all_free(cluster):
            assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
        families = asyncio.run(cluster.worker_metric_families())
        proposed = _spec_samples(families, "tandem_spec_proposed_tokens_total")
        accepted = _spec_samples(families, "tandem_spec_accepted_tokens_total")
        assert accepted["decode"] == proposed["decode"] > 0
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, tiny_model_dir) -> str:
    """Another random model of the vocabulary: drafts mostly rejected, some accepted."""
    from tests.hf_models import write_hf_checkpoint

    return str(write_hf_checkpoint("qwen2", tmp_path_factory.mktemp("draft") / "m", tiny_model_dir,
                                   seed=1))


@pytest.mark.parametrize("mode", [
    dict(mode="colocated", prefill_workers=0, decode_workers=1),
    # the 30-token prompt prefills on the decode worker, the longer ones remotely
    dict(mode="conditional", prefill_workers=1, decode_workers=1, local_prefill_threshold=35),
], ids=["colocated", "conditional"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_other_modes_match_the_offline_engine(ray_session, checkpoint, other_draft, mode, method):
    from tandem.cluster.cluster import Cluster

    prompts = _prompts()
    llm = LLM(checkpoint)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1,
                             adaptive=False, max_batch_size=64) if method == "ngram" else \
        SpeculativeConfig(method="draft", draft_model=other_draft, num_speculative_tokens=3,
                          adaptive=False, max_batch_size=64, draft_prefill_chunk=8)
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=128), speculative=spec)
    cluster = Cluster(ClusterConfig(engine=engine, **mode)).start()
    try:
        for params in PARAMS:
            reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert run_all(cluster, prompts, params) == reference
        for s in wait_all_free(cluster):
            assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
        proposed = _spec_samples(asyncio.run(cluster.worker_metric_families()),
                                 "tandem_spec_proposed_tokens_total")
        assert sum(proposed.values()) > 0
    finally:
        cluster.shutdown()
