"""Scale-down drains first: a decode worker taken out while streams run on it (real Ray
actors, gloo transfers). No stream is cut: every one completes token-identical to the
offline engine, moved to the other decode workers with its KV, or (moves off, drain
timeout 0) re-driven on another decode worker; the router places no new request on the worker from the
moment the drain starts; its actor exits; the cluster serves on with the workers left.
The second drain goes the way of `tandem drain`: a request through the Ray cluster's
key-value store, answered by the gateway. Then the pools are resized (`tandem scale`):
new workers join the transfer group and the router, surplus ones are drained, and the
cluster still serves exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import ray

from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.hf_models import VOCAB
from tests.integration.test_cluster import _config, wait_all_free

# long enough that streams still run when a drain requested through Ray reaches the
# gateway (its requests polled every CONTROL_POLL_S here)
PARAMS = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
CONTROL_POLL_S = 0.02  # at the default 0.5 s, one CI run's streams had all ended first
NUM_STREAMS = 6
NUM_LATE = 3


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(16)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(5, 40))]
            for _ in range(NUM_STREAMS + NUM_LATE)]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return [o.outputs[0].token_ids for o in LLM(checkpoint).generate(prompts, PARAMS)]


def _record_requests(handle) -> list[str]:
    """Every request id the gateway sends to ``handle`` (reserve or local decode)."""
    seen: list[str] = []
    reserve, decode = handle.reserve, handle.decode

    async def recording_reserve(request_id, *args, **kw):
        seen.append(request_id)
        return await reserve(request_id, *args, **kw)

    def recording_decode(req):
        seen.append(req.request_id)
        return decode(req)

    handle.reserve, handle.decode = recording_reserve, recording_decode
    return seen


async def _run(cluster, prompts):
    async def one(prompt):
        return [t async for d in cluster.generate(prompt, PARAMS) for t in d.token_ids]
    return await asyncio.gather(*(one(p) for p in prompts))


def _drain_through_ray(cluster):
    """``drain_worker`` as `tandem drain WORKER` does it (through Ray, to the gateway)."""
    from tandem.cluster import control
    from tandem.cluster.drain import DrainReport

    def drain(worker_id: str, timeout_s: float) -> DrainReport:
        targets = control.find_workers([worker_id], name=cluster.control_name)
        control.request_drain(targets, timeout_s)
        outcome = control.wait_drained(targets, time.monotonic() + 120)[worker_id]
        assert "error" not in outcome, outcome
        return DrainReport(worker_id, outcome["idle"], outcome["redriven"], outcome["seconds"],
                           outcome["migrated"])
    return drain


async def _drain_while_streaming(cluster, prompts, drain_timeout_s, drain):
    """Start the streams; once every one has tokens, drain the decode worker with the
    most of them, and send more requests while it drains. Returns (outputs, victim,
    report, ids the victim got)."""
    got: dict[str, list[int]] = {}
    started = asyncio.Event()

    async def one(rid, prompt):
        tokens = got.setdefault(rid, [])
        async for delta in cluster.generate(prompt, PARAMS, request_id=rid):
            tokens += delta.token_ids
            if len(got) == NUM_STREAMS and all(len(t) >= 2 for t in got.values()):
                started.set()
        return tokens

    streams = [asyncio.ensure_future(one(f"s{i}", p))
               for i, p in enumerate(prompts[:NUM_STREAMS])]
    await started.wait()
    victim = max(cluster.decode, key=lambda w: len(w.active))
    assert victim.active, "no stream runs on the decode workers"
    seen = _record_requests(victim)
    drain = asyncio.ensure_future(asyncio.to_thread(drain, victim.worker_id, drain_timeout_s))
    while victim.worker_id in cluster.router.workers:
        await asyncio.sleep(0.01)
    late = [one(f"late{i}", p) for i, p in enumerate(prompts[NUM_STREAMS:])]
    outputs = await asyncio.gather(*streams, *late)
    return outputs, victim, await drain, seen


def test_drained_decode_workers_cut_no_stream(ray_session, checkpoint, prompts, reference,
                                              monkeypatch):
    """Two drains on one cluster of three decode workers: the first (a cluster call)
    moves the streams with their KV, the second (timeout 0, requested through Ray, moves
    turned off) re-drives them; then one worker is left, and the pool is scaled back to two; the
    prefill pool grows and shrinks too."""
    from tandem.cluster import cluster as cluster_module
    from tandem.cluster import control
    from tandem.cluster.cluster import LOAD_REFRESH_S, Cluster

    monkeypatch.setattr(control, "POLL_S", CONTROL_POLL_S)
    cluster = Cluster(_config(checkpoint, prefill_workers=1, decode_workers=3)).start()
    try:
        node = cluster.placement["decode-0"].node_id  # one node here: every worker's
        on_node = {w for _, w in control.find_workers(node_id=node, name=cluster.control_name)}
        assert on_node == {"prefill-0", "decode-0", "decode-1", "decode-2"}
        for drain_timeout_s, drain in ((60.0, cluster.drain_worker),
                                       (0.0, _drain_through_ray(cluster))):
            redrives_before = cluster.driver.num_redrives
            resumed_before = cluster.router.decisions["local_resume"]
            moving = cluster.config
            if not drain_timeout_s:
                cluster.config = dataclasses.replace(moving, kv_migration=False)
            try:
                outputs, victim, report, seen = asyncio.run(
                    _drain_while_streaming(cluster, prompts, drain_timeout_s, drain))
            finally:
                cluster.config = moving
            assert outputs == reference  # every stream complete, none cut, none diverged
            assert not any(rid.startswith("late") for rid in seen), seen  # none placed there
            assert report.worker_id == victim.worker_id
            redrives = cluster.driver.num_redrives - redrives_before
            if drain_timeout_s:
                assert report.idle and report.redriven == 0 and redrives == 0
                assert report.migrated >= 1  # nothing left to finish in place
                assert cluster.router.decisions["local_resume"] == resumed_before
            else:
                assert not report.idle and report.redriven >= 1 and redrives >= report.redriven
                assert report.migrated == 0
                # every stream had tokens out: each re-drive resumed on a decode worker,
                # placed even where its cache was full at that moment
                assert cluster.router.decisions["local_resume"] - resumed_before == redrives
            # the actor is gone; the cluster serves on with the workers left
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(victim.actor.ready.remote(), timeout=60)
            assert victim not in cluster.decode
            assert victim.worker_id not in cluster.router.workers
            assert victim.worker_id not in cluster.placement
            assert victim.worker_id not in {
                w for _, w in control.find_workers(node_id=node, name=cluster.control_name)}
            assert cluster.rebuilds == 0 and cluster.replacements == 0
            for stats in wait_all_free(cluster):
                assert stats["alive"] and stats["free_blocks"] == stats["total_blocks"]
            assert cluster.router.pending_summary()["requests"] == 0
        # the last decode worker cannot go; an unknown one is named as such
        assert len(cluster.decode) == 1
        with pytest.raises(ValueError, match="last decode worker"):
            cluster.drain_worker(cluster.decode[0].worker_id)
        with pytest.raises(KeyError, match="no worker 'decode-9'"):
            cluster.drain_worker("decode-9")
        with pytest.raises(ValueError, match="no running gateway has a worker 'decode-9'"):
            control.find_workers(["decode-9"], name=cluster.control_name)
        last = control.find_workers([cluster.decode[0].worker_id], name=cluster.control_name)
        control.request_drain(last, 10)
        outcome = control.wait_drained(last, time.monotonic() + 60)
        assert "last decode worker" in outcome[cluster.decode[0].worker_id]["error"]

        # and back up (`tandem scale --decode 2`): a new worker joins group and router
        target = [(cluster.control_name, "decode")]
        at_add: list = []  # every decode worker's load as the router takes the new one
        monkeypatch.setattr(cluster_module, "LOAD_REFRESH_S", 5.0)  # no poll to paper over it
        add_worker = cluster.router.add_worker
        cluster.router.add_worker = lambda w: (at_add.extend(d.load() for d in cluster.decode),
                                               add_worker(w))[1]
        control.request("scale", target, {"workers": 2, "timeout_s": 120})
        outcome = control.wait_answers("scale", target, time.monotonic() + 180)["decode"]
        assert "error" not in outcome, outcome
        (added,) = outcome["added"]
        assert outcome["workers"] == 2 and outcome["drained"] == []
        assert added in cluster.router.workers and added in cluster.placement
        assert cluster.rebuilds == 1  # the transfer group, rebuilt with it
        # loads fetched before the new worker took requests: none read as empty or not alive
        cluster.router.add_worker = add_worker
        monkeypatch.setattr(cluster_module, "LOAD_REFRESH_S", LOAD_REFRESH_S)
        assert at_add and all(ld.alive and ld.total_blocks > 0 for ld in at_add), at_add
        outputs = asyncio.run(_run(cluster, prompts))
        assert outputs == reference
        assert sorted(s["worker_id"] for s in wait_all_free(cluster)) == sorted(
            ["prefill-0", cluster.decode[0].worker_id, added])

        # the prefill pool the same way: a second prefill worker joins, then the newest
        # leaves again (the decode workers receive from every prefill rank: the group
        # is rebuilt each time), and the cluster still serves exactly
        assert cluster.scale("prefill", 2).added == ("prefill-1",)
        assert cluster.scale("prefill", 1).drained == ("prefill-1",)
        assert [w.worker_id for w in cluster.prefill] == ["prefill-0"]
        newest = max((w.worker_id for w in cluster.decode), key=lambda w: int(w.split("-")[1]))
        assert cluster.scale("decode", 1).drained == (newest,)  # the highest-numbered one goes
        assert cluster.rebuilds == 3 and cluster.replacements == 0
        assert asyncio.run(_run(cluster, prompts)) == reference
        with pytest.raises(ValueError, match="timeout_s"):
            cluster.drain_worker(cluster.prefill[0].worker_id, -1)
    finally:
        cluster.shutdown()
