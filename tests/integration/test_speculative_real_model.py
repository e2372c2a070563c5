"""Speculative decoding on the real default model (SmolLM2-135M-Instruct) with both
proposers: greedy chat completions token-identical to transformers loading the same
GGUF, in the offline engine (batched, and preempting) and through the cluster via the
openai SDK (disaggregated with the layer-truncated draft on the decode worker;
conditional with prompt lookup)."""

from __future__ import annotations

import pytest

from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig, SpeculativeConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.engine.spec.truncated_draft import write_truncated_draft
from tests.real_model import MAX_NEW, QUESTIONS, messages

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# Fixed draft lengths, so drafts are verified on every step whatever their acceptance.
DRAFT = dict(speculative="draft", speculative_adaptive=False, num_speculative_tokens=3,
             speculative_max_batch_size=64)
NGRAM = dict(speculative="ngram", speculative_adaptive=False, num_speculative_tokens=3,
             speculative_ngram_min=1, speculative_max_batch_size=64)


@pytest.fixture(scope="module")
def draft_dir(real_model_dir, tmp_path_factory):
    """The target's first 4 of 30 layers: mostly wrong, so drafts are mostly rejected."""
    return write_truncated_draft(real_model_dir, 4, tmp_path_factory.mktemp("draft") / "layers4")


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("blocks", [None, 24], ids=["batched", "preempting"])
def test_offline_engine_matches_transformers(real_model_dir, draft_dir, real_model_reference,
                                             proposer, blocks):
    spec = dict(DRAFT, draft_model=str(draft_dir)) if proposer == "draft" else NGRAM
    # 24 blocks of 4 tokens admit two of the 35-40-token prompts; their growth preempts
    cache = dict(num_blocks=blocks, block_size=4) if blocks else {}
    llm = LLM(str(real_model_dir), dtype="float32", **cache, **spec)
    outs = llm.chat([messages(q) for q in QUESTIONS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == real_model_reference["outputs"]
    engine = llm.engine
    assert engine.speculator.num_proposed > 0
    if blocks is not None:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


@pytest.mark.parametrize("mode,proposer", [("disaggregated", "draft"), ("conditional", "ngram")])
def test_the_cluster_matches_transformers(ray_session, real_model_dir, draft_dir,
                                          real_model_reference, mode, proposer):
    """Disaggregated: the decode worker loads the truncated draft, catches it up on the
    imported prompts in bounded chunks and verifies its drafts. Conditional: the shorter
    prompts prefill on the decode worker, the longer remotely, prompt lookup drafts.
    Either way, the text transformers generates."""
    import openai

    from tandem.cluster.backend import ClusterBackend
    from tandem.cluster.cluster import Cluster
    from tandem.engine.model.config import ModelConfig
    from tandem.gateway.app import create_app
    from tandem.gateway.server import ServerThread
    from tandem.text.tokenizer import Tokenizer

    common = dict(adaptive=False, num_speculative_tokens=3, max_batch_size=64)
    spec = SpeculativeConfig(method="draft", draft_model=str(draft_dir), draft_prefill_chunk=16,
                             **common) if proposer == "draft" else \
        SpeculativeConfig(method="ngram", ngram_min=1, **common)
    engine = EngineConfig(model=str(real_model_dir), dtype="float32",
                          cache=CacheConfig(num_blocks=64), speculative=spec)
    lengths = sorted(len(p) for p in real_model_reference["prompts"])
    cluster = Cluster(ClusterConfig(mode=mode, engine=engine, prefill_workers=1, decode_workers=1,
                                    local_prefill_threshold=lengths[len(lengths) // 2])).start()
    mc = ModelConfig.from_dir(real_model_dir)
    app = create_app(ClusterBackend(cluster, "smollm2", mc.max_position_embeddings, mc.vocab_size),
                     Tokenizer.from_dir(real_model_dir), request_timeout_s=300)
    tok = real_model_reference["tokenizer"]
    try:
        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            for question, expected in zip(QUESTIONS, real_model_reference["outputs"]):
                reply = client.chat.completions.create(
                    model="smollm2", messages=messages(question), max_tokens=MAX_NEW, temperature=0)
                assert reply.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
                assert reply.usage.completion_tokens == len(expected)
            metrics = __import__("httpx").get(server.url + "/metrics", timeout=10).text
        proposed = [line for line in metrics.splitlines()
                    if line.startswith("tandem_spec_proposed_tokens_total") and 'role="decode"' in line]
        assert proposed and float(proposed[0].rsplit(" ", 1)[1]) > 0
    finally:
        cluster.shutdown()
