"""Failures on real Ray actors: a decode or prefill worker killed mid-flight, and callers
that leave; every request still completes token-identically, nothing leaks or hangs."""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import aclosing

import pytest
import ray

from tandem.common.config import ClusterConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.hf_models import VOCAB
from tests.integration.test_cluster import _config, wait_all_free

LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
# A send in flight to a killed decode worker ends when the heal has started a new actor and
# rebuilt the transfer group, or at the transfer timeout, whichever comes first; only then
# are the prompt's blocks held for it on the prefill worker freed.
AFTER_SENDS_END_S = ClusterConfig().transfer_timeout_s + 15.0


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (9, 33, 70, 120, 21, 50)]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return [o.outputs[0].token_ids for o in LLM(checkpoint).generate(prompts, LONG)]


@pytest.fixture
def cluster(ray_session, checkpoint):
    from tandem.cluster.cluster import Cluster

    c = Cluster(_config(checkpoint, prefill_workers=2, decode_workers=2)).start()
    yield c
    c.shutdown()


async def _stream_all(cluster, prompts, on_progress):
    got = [[] for _ in prompts]

    async def one(i):
        index = 0
        async for delta in cluster.generate(prompts[i], LONG):
            assert delta.index == index, f"request {i}: token lost or repeated"
            got[i] += delta.token_ids
            index = delta.next_index
            await on_progress(got)
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), 120)
    return got


def _stream_all_killing(cluster, prompts, victim):
    """Stream every prompt; kill ``victim`` once half the streams have 3 tokens."""
    killed = []

    async def on_progress(got):
        if not killed and sum(len(g) >= 3 for g in got) >= len(got) // 2:
            killed.append(victim.worker_id)
            ray.kill(victim.actor, no_restart=True)

    got = asyncio.run(_stream_all(cluster, prompts, on_progress))
    assert killed, "the streams ended before the kill"
    return got


def test_decode_worker_killed_mid_stream(cluster, prompts, reference):
    victim = cluster.decode[0]
    got = _stream_all_killing(cluster, prompts, victim)
    assert got == reference
    assert cluster.driver.num_redrives > 0
    survivors = [s for s in wait_all_free(cluster, AFTER_SENDS_END_S)
                 if s["worker_id"] != victim.worker_id]
    assert all(s["free_blocks"] == s["total_blocks"] for s in survivors)


@pytest.mark.parametrize("mode", ["colocated", "conditional"])
def test_a_worker_killed_mid_stream_in_the_other_modes(ray_session, checkpoint, prompts,
                                                       reference, mode):
    """Colocated workers run both phases, and a conditional cluster prefills short prompts
    on the decode worker: a worker killed with streams under way still costs no token,
    and each stream already under way resumes on a survivor, which prefills it itself."""
    from tandem.cluster.cluster import Cluster

    workers = dict(prefill_workers=1, decode_workers=1) if mode == "colocated" else \
        dict(prefill_workers=1, decode_workers=2, local_prefill_threshold=40)
    cluster = Cluster(_config(checkpoint, mode=mode, **workers)).start()
    try:
        victim = cluster.decode[0]
        assert _stream_all_killing(cluster, prompts, victim) == reference
        redrives = cluster.driver.num_redrives
        assert 0 < cluster.router.decisions["local_resume"] <= redrives
        survivors = [s for s in wait_all_free(cluster, AFTER_SENDS_END_S)
                     if s["worker_id"] != victim.worker_id]
        assert survivors and all(
            s["free_blocks"] == s["total_blocks"] and s["held"] == 0 for s in survivors)
        assert cluster.router.pending_summary()["requests"] == 0
    finally:
        cluster.shutdown()


def test_prefill_worker_killed(cluster, prompts, reference):
    victim = cluster.prefill[0]
    ray.kill(victim.actor, no_restart=True)  # the router still believes it alive

    async def on_progress(got):
        pass

    got = asyncio.run(_stream_all(cluster, prompts, on_progress))
    assert got == reference
    survivors = [s for s in wait_all_free(cluster) if s["worker_id"] != victim.worker_id]
    assert all(s["free_blocks"] == s["total_blocks"] and s["held"] == 0 for s in survivors)


def test_callers_leaving_free_everything(cluster, prompts):
    async def leave_after(prompt, n):
        got = 0
        async with aclosing(cluster.generate(prompt, LONG)) as stream:
            async for delta in stream:
                got += len(delta.token_ids)
                if got >= n:
                    break  # the client went away

    async def main():
        await asyncio.wait_for(asyncio.gather(
            *(leave_after(p, n) for p, n in zip(prompts * 3, [1, 2, 5] * 6))), 60)
    asyncio.run(main())
    stats = wait_all_free(cluster)
    full = asyncio.run(cluster.worker_stats())
    assert all(s["free_blocks"] == s["total_blocks"] and s["held"] == 0 for s in stats), [{k: v for k, v in s.items() if k != "request_ids"} for s in full]
    assert cluster.router.pending_summary()["requests"] == 0


def test_dead_worker_is_replaced_and_serves_again(cluster, prompts, reference):
    victim = cluster.decode[1]
    old_actor = victim.actor
    ray.kill(old_actor, no_restart=True)

    async def on_progress(got):
        pass

    assert asyncio.run(_stream_all(cluster, prompts, on_progress)) == reference
    deadline = time.monotonic() + 120
    while cluster.replacements == 0 and time.monotonic() < deadline:
        asyncio.run(_stream_all(cluster, prompts[:1], on_progress))  # keeps the refresher going
        time.sleep(0.5)
    assert cluster.replacements >= 1 and victim.actor is not old_actor
    # Both decode workers take traffic again, and every output is still exact.
    assert asyncio.run(_stream_all(cluster, prompts * 2, on_progress)) == reference * 2
    stats = wait_all_free(cluster)
    assert len(stats) == 4
    assert all(s["free_blocks"] == s["total_blocks"] for s in stats)
    assert {s["worker_id"] for s in stats if s.get("kv_bytes_received")} == {"decode-0", "decode-1"}


def test_an_idle_cluster_heals_a_killed_worker_without_any_request(cluster):
    """The refresher runs from start-up: nobody has to send a request for a dead worker
    to be noticed and replaced."""
    victim = cluster.prefill[1]
    old = victim.actor
    ray.kill(old, no_restart=True)
    deadline = time.monotonic() + 120
    while cluster.replacements == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.replacements == 1 and victim.actor is not old
    assert ray.get(victim.actor.load.remote())["alive"]


def test_a_broken_channel_makes_the_worker_not_alive_until_the_group_is_rebuilt(
        cluster, prompts, reference):
    from tandem.cluster.backend import ClusterBackend

    backend = ClusterBackend(cluster, "m", 512, VOCAB)
    rebuilds = cluster.rebuilds
    ray.get(cluster.decode[0].actor.leave_transfer_group.remote())  # its end of the channel
    load = ray.get(cluster.decode[0].actor.load.remote())
    assert not load["alive"] and load["engine_alive"] and load["transfer_broken"]
    deadline = time.monotonic() + 120
    while cluster.rebuilds == rebuilds and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.rebuilds == rebuilds + 1 and cluster.replacements == 0  # rebuilt, not replaced
    assert asyncio.run(backend.ready())
    assert ray.get(cluster.decode[0].actor.load.remote())["alive"]

    async def on_progress(got):
        pass
    assert asyncio.run(_stream_all(cluster, prompts, on_progress)) == reference
