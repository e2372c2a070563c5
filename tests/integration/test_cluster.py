"""The disaggregated cluster on real Ray actors with the gloo transport: token-identical to
the offline engine in every mode, KV bytes accounted, every block free afterwards."""

from __future__ import annotations

import asyncio
import gc
import random
import time

import pytest
import ray

from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.hf_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LENGTHS = [1, 5, 16, 17, 40, 63, 90, 130]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return [o.outputs[0].token_ids for o in LLM(checkpoint).generate(prompts, GREEDY)]


def _config(checkpoint: str, **kw) -> ClusterConfig:
    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=128))
    return ClusterConfig(engine=engine, **kw)


async def _collect(cluster, prompt, params=GREEDY):
    tokens, index = [], 0
    async for delta in cluster.generate(prompt, params):
        assert delta.index == index, "deltas arrive in order, none lost or repeated"
        tokens += delta.token_ids
        index = delta.next_index
        last = delta
    assert last.finished
    return tokens


def run_all(cluster, prompts, params=GREEDY):
    async def main():
        return await asyncio.gather(*(_collect(cluster, p, params) for p in prompts))
    return asyncio.run(main())


def wait_all_free(cluster, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = asyncio.run(cluster.worker_stats())
        live = [s for s in stats if s["alive"]]
        if all(s["free_blocks"] == s["total_blocks"] and s["held"] == 0 for s in live) \
                or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def block_bytes(checkpoint: str, block_size: int = 16) -> int:
    from tandem.engine.model.config import ModelConfig

    mc = ModelConfig.from_dir(checkpoint)
    return mc.num_layers * 2 * block_size * mc.num_kv_heads * mc.head_dim * 4


MODES = {
    "1P1D": dict(prefill_workers=1, decode_workers=1),
    "2P2D": dict(prefill_workers=2, decode_workers=2, layer_group_size=1, checksum=True),
    "colocated": dict(mode="colocated", prefill_workers=1, decode_workers=1),
    "conditional": dict(mode="conditional", prefill_workers=1, decode_workers=1,
                        local_prefill_threshold=20),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_outputs_match_offline_engine(ray_session, checkpoint, prompts, reference, mode):
    from tandem.cluster.cluster import Cluster

    cluster = Cluster(_config(checkpoint, **MODES[mode])).start()
    try:
        assert run_all(cluster, prompts) == reference
        workers = cluster.prefill + cluster.decode  # each froze its start-up heap (engine/gc_freeze.py)
        assert all(ray.get([w.actor.__ray_call__.remote(lambda actor: gc.get_freeze_count() > 0)
                            for w in workers], timeout=60))
        stats = wait_all_free(cluster)
        for s in stats:
            assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
            assert s["held"] == 0 and s["running"] == 0 and s["waiting"] == 0
        sent = sum(s.get("kv_bytes_sent", 0) for s in stats)
        received = sum(s.get("kv_bytes_received", 0) for s in stats)
        assert sent == received
        remote = [n for n in LENGTHS if mode not in ("colocated",)
                  and not (mode == "conditional" and n < 20)]
        assert sent == sum(-(-n // 16) for n in remote) * block_bytes(checkpoint)
        decisions = cluster.router.decisions
        if mode == "conditional":
            assert decisions["local_short_prompt"] == sum(n < 20 for n in LENGTHS)
            assert decisions["remote"] == sum(n >= 20 for n in LENGTHS)
        assert cluster.router.pending_summary()["requests"] == 0
    finally:
        cluster.shutdown()


def test_conditional_keeps_prompts_local_while_the_prefill_worker_has_a_backlog(
        ray_session, checkpoint, prompts, reference):
    """Saturation by wait: with a zero-second bound, once the prefill worker has measured
    its rate, a prompt goes there only while nothing is queued on it; the rest prefill on
    the decode worker. Every output still equals the offline engine's."""
    from tandem.cluster.cluster import Cluster

    cluster = Cluster(_config(checkpoint, mode="conditional", prefill_workers=1,
                              decode_workers=1, local_prefill_threshold=0,
                              prefill_saturation_s=0.0)).start()
    try:
        assert run_all(cluster, prompts[-1:]) == reference[-1:]
        deadline = time.monotonic() + 10
        while cluster.prefill[0].load().prefill_tokens_per_s == 0.0:
            assert time.monotonic() < deadline, "the prefill worker published no rate"
            time.sleep(0.05)
        assert run_all(cluster, prompts) == reference
        decisions = cluster.router.decisions
        assert decisions["remote"] >= 2 and decisions["local_prefill_saturated"] >= 1
        assert decisions["remote"] + decisions["local_prefill_saturated"] == len(prompts) + 1
        for s in wait_all_free(cluster):
            assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
    finally:
        cluster.shutdown()


def test_in_place_transfers_match_offline_engine(ray_session, checkpoint, prompts, reference):
    """Every run sent from and received into the caches in place (threshold 0), twice:
    the second wave reuses freed blocks."""
    from tandem.cluster.cluster import Cluster

    cluster = Cluster(_config(checkpoint, prefill_workers=1, decode_workers=1,
                              kv_in_place_min_bytes=0)).start()
    try:
        for _ in range(2):
            assert run_all(cluster, prompts) == reference
        stats = wait_all_free(cluster)
        for s in stats:
            assert s["free_blocks"] == s["total_blocks"], f"{s['worker_id']} leaked blocks"
        prefill = [s for s in stats if s["role"] == "prefill"]
        assert sum(s["kv_groups_in_place"] for s in prefill) > 0
        assert sum(s["kv_groups_gathered"] for s in prefill) == 0
        sent = sum(s.get("kv_bytes_sent", 0) for s in stats)
        assert sent == sum(s.get("kv_bytes_received", 0) for s in stats)
        assert sent == 2 * sum(-(-n // 16) for n in LENGTHS) * block_bytes(checkpoint)
    finally:
        cluster.shutdown()
