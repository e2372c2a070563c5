"""Chaos: a real cluster (1 prefill + 2 decode on Ray, gloo, one layer per KV group, KV
written in place) under mixed load while clients leave after token #1 with long prompts'
KV still streaming, requests are cancelled at every stage, running requests are moved
between the decode workers with their KV all along, the prefill worker and a decode
worker are SIGKILLed (the latter with moves to it and from it under way) and one
worker's transfer channel is torn down.

Afterwards: every completed greedy response is token-identical to the offline engine,
and so is every abandoned prompt asked again; every request completed or ended with an
explicit error (none hangs); every KV block is free; every worker is ready again.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import time

import pytest

from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tests.hf_models import VOCAB
from tests.integration.test_cluster import wait_all_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)  # long enough to move


def _params(i: int) -> SamplingParams:
    return LONG if i % 6 == 0 else GREEDY
REQUEST_BOUND_S = 150.0  # a request still open after this is a hang
LENGTHS = [6, 20, 45, 90, 160, 250, 330, 400]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(12)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in LENGTHS * 3]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    llm = LLM(checkpoint)
    return [llm.generate([p], _params(i))[0].outputs[0].token_ids for i, p in enumerate(prompts)]


@pytest.fixture
def cluster(ray_session, checkpoint):
    from tandem.cluster.cluster import Cluster

    engine = EngineConfig(model=checkpoint, cache=CacheConfig(num_blocks=512))
    c = Cluster(ClusterConfig(engine=engine, prefill_workers=1, decode_workers=2,
                              layer_group_size=1, kv_in_place_min_bytes=0,
                              transfer_timeout_s=10.0, max_attempts=4)).start()
    yield c
    c.shutdown()


class Outcomes:
    def __init__(self) -> None:
        self.by_kind: dict[str, list[int]] = collections.defaultdict(list)
        self.completed: list[tuple[int, list[int]]] = []
        self.errors: list[str] = []
        self.reasons: dict[int, object] = {}  # finish reason of each completed request

    def summary(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.by_kind.items()}


async def _request(cluster, i: int, prompt, how: str, out: Outcomes) -> None:
    """``how``: complete | leave (after token #1) | cancel (the task is cancelled)."""
    tokens, index = [], 0
    try:
        async def run():
            nonlocal index
            gen = cluster.generate(prompt, _params(i))
            try:
                async for delta in gen:
                    assert delta.index == index, f"request {i}: token lost or repeated"
                    tokens.extend(delta.token_ids)
                    index = delta.next_index
                    if how == "leave":
                        return "left"
                    if delta.finished:
                        out.reasons[i] = delta.finish_reason
                        return "completed"
                return "ended without finishing"
            finally:
                await gen.aclose()
        kind = await asyncio.wait_for(run(), REQUEST_BOUND_S)
    except asyncio.CancelledError:
        out.by_kind["cancelled"].append(i)
        raise
    except asyncio.TimeoutError:
        kind = "hung"
    except Exception as e:  # noqa: BLE001 - an explicit error is an allowed outcome
        kind = "error"
        out.errors.append(f"{type(e).__name__}: {str(e)[:120]}")
    out.by_kind[kind].append(i)
    if kind == "completed":
        out.completed.append((i, tokens))


async def _kill(worker) -> None:
    pid = await worker.actor.pid.remote()
    os.kill(pid, signal.SIGKILL)


async def _until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.1)
    return cond()


def _move_some(cluster, moves: list, rng: random.Random, k: int = 4) -> None:
    """Ask that up to ``k`` running requests move to the other decode worker."""
    running = sorted(r for w in cluster.decode for r in w.active)
    for rid in rng.sample(running, min(k, len(running))):
        try:
            moves.append(cluster.migrate(rid))
        except Exception:  # noqa: BLE001 - ended, moving already, or no room: a defined answer
            pass


async def _mover(cluster, moves: list, chaos: asyncio.Task) -> None:
    rng = random.Random(3)
    while not chaos.done():
        _move_some(cluster, moves, rng)
        await asyncio.sleep(rng.uniform(0.05, 0.3))


async def _chaos(cluster, log: list[str], moves: list) -> None:
    await asyncio.sleep(1.0)
    await _kill(cluster.prefill[0])
    log.append("SIGKILL prefill-0")
    assert await _until(lambda: cluster.replacements >= 1, 120), "prefill-0 was not replaced"
    await asyncio.sleep(1.0)
    rebuilds = cluster.rebuilds
    await cluster.decode[0].actor.leave_transfer_group.remote()  # its channel end is gone
    log.append("channel fault on decode-0")
    assert await _until(lambda: cluster.rebuilds > rebuilds, 120), "the group was not rebuilt"
    await asyncio.sleep(1.0)
    _move_some(cluster, moves, random.Random(5), k=16)  # to decode-1 and from it
    await asyncio.sleep(0.05)
    await _kill(cluster.decode[1])
    log.append("SIGKILL decode-1")
    assert await _until(lambda: cluster.replacements >= 2, 120), "decode-1 was not replaced"


async def _load(cluster, prompts, out: Outcomes, chaos: asyncio.Task) -> None:
    rng = random.Random(7)
    tasks: list[asyncio.Task] = []
    wave = 0
    while not chaos.done() or wave < 2:
        for i, prompt in enumerate(prompts):
            how = ("complete", "complete", "leave", "cancel")[(i + wave) % 4]
            task = asyncio.ensure_future(_request(cluster, i, prompt, how, out))
            tasks.append(task)
            if how == "cancel":  # at any stage: queued, reserving, prefilling, ..., decoding
                asyncio.get_running_loop().call_later(rng.uniform(0.0, 1.5), task.cancel)
            await asyncio.sleep(rng.uniform(0.0, 0.05))
        wave += 1
        await asyncio.sleep(0.5)
    await asyncio.gather(*tasks, return_exceptions=True)


def test_chaos(cluster, prompts, reference):
    out, log, moves = Outcomes(), [], []

    async def main():
        chaos = asyncio.ensure_future(_chaos(cluster, log, moves))
        mover = asyncio.ensure_future(_mover(cluster, moves, chaos))
        await _load(cluster, prompts, out, chaos)
        await chaos  # re-raises if a fault was not healed
        await mover

    t0 = time.monotonic()
    asyncio.run(main())
    print(f"chaos: {log}; outcomes {out.summary()}; {cluster.driver.num_redrives} re-drives, "
          f"{cluster.replacements} replacements, {cluster.rebuilds} rebuilds, "
          f"{time.monotonic() - t0:.0f}s; errors: {collections.Counter(out.errors)}")
    assert log == ["SIGKILL prefill-0", "channel fault on decode-0", "SIGKILL decode-1"]
    assert not out.by_kind.get("hung") and not out.by_kind.get("ended without finishing")
    assert len(out.completed) >= len(prompts), out.summary()
    # every move asked for ended one way or the other (none hangs)
    results = [m.result(timeout=REQUEST_BOUND_S) for m in moves]
    print("moves:", collections.Counter(r.outcome for r in results),
          collections.Counter((r.error or "")[:60] for r in results))
    assert moves
    for i, tokens in out.completed:
        assert tokens == reference[i], (
            f"request {i} (prompt of {len(prompts[i])}) answered wrong: {len(tokens)} tokens, "
            f"finished by {out.reasons.get(i)}")
    # every worker ready again, every block free, nothing tracked
    assert asyncio.run(_until_ready(cluster)), [w.load() for w in cluster.prefill + cluster.decode]
    stats = wait_all_free(cluster, timeout_s=30)
    assert len(stats) == 3
    assert all(s["free_blocks"] == s["total_blocks"] and s["held"] == 0 for s in stats), str([
        {k: s.get(k) for k in ("worker_id", "free_blocks", "total_blocks", "held", "running",
                               "waiting", "request_ids", "pending_transfers")} for s in stats]
    ) + "\n" + str(_internals(cluster))
    assert cluster.router.pending_summary()["requests"] == 0
    # the abandoned prompts, asked again, come back exact (no corrupted prefix-cache blocks)
    abandoned = sorted(set(out.by_kind["left"]) | set(out.by_kind["cancelled"]))
    again = Outcomes()

    async def ask_again():
        await asyncio.gather(*(_request(cluster, i, prompts[i], "complete", again)
                               for i in abandoned))
    asyncio.run(ask_again())
    assert again.summary() == {"completed": len(abandoned)}, (again.summary(), again.errors)
    for i, tokens in again.completed:
        assert tokens == reference[i], f"abandoned prompt {i} answered wrong when asked again"


def _internals(cluster) -> dict:
    """Each worker's bookkeeping of who holds its blocks, read inside its actor."""
    import ray

    def _probe(worker) -> dict:
        """Inside a worker's actor: the state that says who still holds its blocks."""
        def keys(obj, name):
            try:
                return sorted(getattr(obj, name))[:20]
            except Exception as e:  # noqa: BLE001 - read while the engine thread runs
                return repr(e)
        sched = worker.engine.scheduler
        state = {"prefilled": keys(sched, "prefilled"), "reserved": keys(sched, "reserved")}
        for name in ("requests", "_aborted_transfers"):
            if hasattr(worker, name):
                state[name] = keys(worker, name)
        sender = getattr(worker, "sender", None)
        if sender is not None:
            try:
                state["sender"] = {"closed": sender._closed, "open": keys(sender, "_open"),
                                   "failed": keys(sender, "_failed"),
                                   "threads alive": (sender._thread.is_alive(),
                                                     sender._completer.is_alive())}
            except Exception as e:  # noqa: BLE001 - diagnostics only
                state["sender"] = repr(e)
        return state

    out = {}
    for w in cluster.prefill + cluster.decode:
        try:
            out[w.worker_id] = ray.get(w.actor.__ray_call__.remote(_probe), timeout=10)
        except Exception as e:  # noqa: BLE001 - diagnostics only
            out[w.worker_id] = repr(e)
    return out


async def _until_ready(cluster) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await cluster.refresh_loads()
        if cluster.serving and all(w.load().alive for w in cluster.prefill + cluster.decode):
            return True
        await asyncio.sleep(0.2)
    return False
