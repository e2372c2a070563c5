"""Speculative decoding in the decode pool of a real disaggregated cluster (Ray actors,
gloo KV transfer): outputs token-identical to the offline engine without speculation,
the draft counters exported by the decode worker only, every block free afterwards."""

from __future__ import annotations

import asyncio
import random

from services.common.config import CacheConfig, ClusterConfig, EngineConfig, SpeculativeConfig
from services.common.sampling_params import SamplingParams
from services.engine import LLM
from tests.hf_models import VOCAB
from tests.integration.test_cluster import run_all, wait_all_free

PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=24, ignore_eos=True,
                         frequency_penalty=0.3)]


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    units = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 7, 11)]
    return [u * (40 // len(u)) for u in units] + [[rng.randrange(2, VOCAB) for _ in range(30)]]


def _spec_samples(families, name: str) -> dict[str, float]:
    return {s.labels["role"]: s.value for f in families for s in f.samples if s.name == name}


def test_disaggregated_outputs_match_offline_engine(ray_session, checkpoint):
    from services.cluster.cluster import Cluster

    prompts = _prompts()
    llm = LLM(checkpoint)
    references = [[o.outputs[0].token_ids for o in llm.generate(prompts, p)] for p in PARAMS]
    # 1-grams and a fixed k: a random model's output matches its prompt often enough
    # that the decode worker verifies drafts on most steps, accepted or not.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1,
                             adaptive=False, max_batch_size=64)
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=128), speculative=spec)
    cluster = Cluster(ClusterConfig(engine=engine, prefill_workers=1, decode_workers=1)).start()
    try:
        for params, reference in zip(PARAMS, references):
            assert run_all(cluster, prompts, params) == reference
        for s in wait_all_free(cluster):
            assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
        families = asyncio.run(cluster.worker_metric_families())
        proposed = _spec_samples(families, "tandem_spec_proposed_tokens_total")
        accepted = _spec_samples(families, "tandem_spec_accepted_tokens_total")
        assert proposed["decode"] > 0 and proposed.get("prefill", 0) == 0
        assert 0 <= accepted["decode"] <= proposed["decode"]
        drafts = _spec_samples(families, "tandem_spec_acceptance_length_count")
        assert drafts["decode"] > 0
    finally:
        cluster.shutdown()
