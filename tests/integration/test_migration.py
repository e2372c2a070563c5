"""Running requests move between decode workers with their KV (real Ray actors, gloo):
every stream completes token-identical to the offline engine (greedy and seeded), no
prompt token is prefilled again, the source's blocks are freed only after the
destination committed, and a move that cannot be made leaves the request where it was."""

from __future__ import annotations

import asyncio
import random

import pytest

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

    c = Cluster(_config(checkpoint, prefill_workers=1, decode_workers=2)).start()
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


def _prefilled_tokens(cluster) -> int:
    stats = asyncio.run(cluster.worker_stats())
    return sum(s.get("prompt_tokens_computed", 0) for s in stats)


def test_running_requests_move_with_their_kv(cluster, prompts, reference):
    """Each request moves to the other decode worker mid-stream (``Cluster.migrate``):
    outputs identical, counted as migrated, nothing prefilled again, nothing leaked."""
    before = cluster.migrations.metrics.moves.labels(MIGRATED)._value.get()
    redrives = cluster.driver.num_redrives

    def move_all(c, rids):
        return [c.migrate(rid).result(timeout=60) for rid in rids]

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
    def fill_and_move(c, rids):
        src = c.router.decode_of(rids[0])
        dst = next(w for w in c.decode if w is not src)
        held = asyncio.run(_hold_all_blocks(dst))
        try:
            return c.migrate(rids[0], to=dst.worker_id).result(timeout=60)
        finally:
            asyncio.run(_release(dst, held))

    outputs, result = asyncio.run(_streams_with_moves(cluster, prompts, fill_and_move))
    assert outputs == reference
    assert result.outcome == FAILED and "room" in (result.error or ""), result
    wait_all_free(cluster)


async def _hold_all_blocks(worker) -> list[str]:
    """Reserve every free block of ``worker`` through its own calls (as a migration in)."""
    held = []
    for i in range(64):
        desc = await worker.migrate("migrate_in", f"filler-{i}", [1] * 16, GREEDY, 0,
                                    f"filler-{i}#t", 16 * 8, 0)
        if desc is None:
            break
        held.append(f"filler-{i}")
    return held


async def _release(worker, held: list[str]) -> None:
    for rid in held:
        await worker.abort(rid)
