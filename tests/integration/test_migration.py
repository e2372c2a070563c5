"""Running requests move between decode workers with their KV (real Ray actors, gloo):
every stream completes token-identical to the offline engine (greedy and seeded), no
prompt token is prefilled again, the source's blocks are freed only after the
destination committed, and a move that cannot be made leaves the request where it was.
A pool out of balance evens out by itself (rebalancing)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from tandem.common.config import CacheConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.router.migration import FAILED, MIGRATED
from tests.hf_models import VOCAB
from tests.integration.test_cluster import _config, wait_all_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=160, ignore_eos=True)
NUM_STREAMS = 4


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(60)
    # long enough for full blocks to go in the pre-copy (block size 16)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(40, 90))]
            for _ in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def cluster(ray_session, checkpoint):
    from tandem.cluster.cluster import Cluster

    config = _config(checkpoint, prefill_workers=1, decode_workers=2)
    engine = dataclasses.replace(config.engine, cache=CacheConfig(num_blocks=384))
    c = Cluster(dataclasses.replace(config, engine=engine)).start()
    c.config = dataclasses.replace(c.config, rebalance=False)  # only the moves a test asks for
    yield c
    c.shutdown()


def _params(i: int) -> SamplingParams:
    return GREEDY if i % 2 == 0 else SEEDED


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    llm = LLM(checkpoint)
    return [llm.generate([p], _params(i))[0].outputs[0].token_ids for i, p in enumerate(prompts)]


async def _streams_with_moves(cluster, prompts, move):
    """Run the streams; once each has a few tokens, ``move(cluster, rids)`` (in a thread).
    Returns (outputs, whatever ``move`` returned)."""
    got: dict[str, list[int]] = {}
    started = asyncio.Event()

    async def one(i, prompt):
        rid = f"m{i}"
        tokens = got.setdefault(rid, [])
        index = 0
        async for delta in cluster.generate(prompt, _params(i), request_id=rid):
            assert delta.index == index, "no token lost or repeated across a move"
            index = delta.next_index
            tokens += delta.token_ids
            if len(got) == len(prompts) and all(len(t) >= 3 for t in got.values()):
                started.set()
        return tokens

    streams = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    await started.wait()
    moved = await asyncio.to_thread(move, cluster, sorted(got))
    return await asyncio.gather(*streams), moved


def test_running_requests_move_with_their_kv(cluster, prompts, reference):
    """Each request moves to the other decode worker mid-stream (``Cluster.migrate``):
    outputs identical, counted as migrated, nothing prefilled again, nothing leaked."""
    before = cluster.migrations.metrics.moves.labels(MIGRATED)._value.get()
    redrives = cluster.driver.num_redrives

    def move_all(c, rids):
        moves = [c.migrate(rid) for rid in rids]  # all at once: they run side by side
        return [m.result(timeout=60) for m in moves]

    outputs, results = asyncio.run(_streams_with_moves(cluster, prompts, move_all))
    assert outputs == reference
    assert [r.outcome for r in results] == [MIGRATED] * len(prompts), results
    assert all(r.kv_bytes > 0 and r.pause_s is not None for r in results)
    assert cluster.driver.num_redrives == redrives  # none prefilled again
    after = cluster.migrations.metrics.moves.labels(MIGRATED)._value.get()
    assert after - before == len(prompts)
    wait_all_free(cluster)


def test_a_move_to_a_full_worker_leaves_the_request_in_place(cluster, prompts, reference):
    """The destination has no room: the move fails, the stream goes on on its worker."""
    full = cluster.decode[1]
    held = asyncio.run(_hold_all_blocks(full))  # before the streams: they all go elsewhere
    try:
        cluster.refresh_loads_now()

        def move(c, rids):
            return c.migrate(rids[0], to=full.worker_id).result(timeout=60)

        outputs, result = asyncio.run(_streams_with_moves(cluster, prompts, move))
    finally:
        asyncio.run(_release(full, held))
    assert outputs == reference
    assert result.outcome == FAILED and "room" in (result.error or ""), result
    wait_all_free(cluster)


async def _hold_all_blocks(worker) -> list[str]:
    """Reserve every free block of ``worker`` through its own calls (as a migration in)."""
    held = []
    for blocks in (32, 1):  # big reservations first, then what is left one block at a time
        while True:
            rid = f"filler-{len(held)}"
            desc = await worker.migrate("migrate_in", rid, [1] * 16, GREEDY, 0, f"{rid}#t",
                                        16 * blocks, 0)
            if desc is None:
                break
            held.append(rid)
    return held


async def _release(worker, held: list[str]) -> None:
    for rid in held:
        await worker.abort(rid)


def _usage(worker) -> float:
    load = worker.load()
    return 1.0 - load.free_blocks / load.total_blocks


def test_a_pool_out_of_balance_evens_out(cluster, checkpoint):
    """Every long-context stream starts on one decode worker while the other is idle; with
    rebalancing on, their KV usage evens out while the streams run, outputs exact."""
    from tandem.cluster.rebalance import START_GAP

    rng = random.Random(61)
    # 12 x 480 tokens: 360 of d0's 384 blocks at the end, 216 once prefilled
    prompts = [[rng.randrange(2, VOCAB) for _ in range(280)] for _ in range(12)]
    params = dataclasses.replace(GREEDY, max_tokens=200)
    reference = [o.outputs[0].token_ids for o in LLM(checkpoint).generate(prompts, params)]
    d0, d1 = cluster.decode
    gaps: list[float] = []

    async def main():
        cluster.router.remove_worker(d1.worker_id)  # every stream goes to d0
        streams = [asyncio.ensure_future(_collect(cluster, p, params)) for p in prompts]
        while len(cluster.driver.running()) < len(prompts):  # all decoding on d0
            await asyncio.sleep(0.02)
        cluster.router.add_worker(d1)
        cluster.refresh_loads_now()
        assert not d1.active and _usage(d0) - _usage(d1) >= START_GAP, (_usage(d0), _usage(d1))
        cluster.config = dataclasses.replace(cluster.config, rebalance=True)
        try:
            while not all(s.done() for s in streams):
                gaps.append(abs(_usage(d0) - _usage(d1)))
                if d1.active and gaps[-1] < START_GAP:
                    break
                await asyncio.sleep(0.05)
            return await asyncio.gather(*streams)
        finally:
            cluster.config = dataclasses.replace(cluster.config, rebalance=False)

    moved_before = cluster.rebalancer.moves_asked
    outputs = asyncio.run(main())
    assert outputs == reference
    assert cluster.rebalancer.moves_asked > moved_before
    assert gaps and gaps[-1] < START_GAP, gaps  # evened out while the streams ran
    wait_all_free(cluster)


async def _collect(cluster, prompt, params):
    return [t async for d in cluster.generate(prompt, params) for t in d.token_ids]
