"""A real DecodeWorker (tiny model, in process) under random orders of what can happen to a
remote-prefill request: its reserve, its KV groups (some held mid-write), its start, an
abort, its client leaving, a transfer timing out, a re-drive of the same id. After each
run: every block free, nothing held, no free before the request's transfer was over (a
transfer ends under the lock its in-place writes hold, so no write is then in flight), and
every stream ended (tokens to the end, or an error)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import pytest

from tandem.decode.lifecycle import DecodeState
from tandem.decode.worker import TransferFailedError
from tandem.protocol.request_path import DecodeRequest
from tandem.transfer.sender import SendJob
from tests.decode_stream import decode_stream
from tests.unit.test_decode_release import PARAMS, PROMPT, _all_free, _connect, worker  # noqa: F401

RUNS = 18
ENDS = ("abort", "client gone", "timeout", "none")


async def _one_run(worker, rng: random.Random, run: int, frees: list) -> None:
    tid = f"x{run}#0"
    held_write = rng.random() < 0.5
    channel, sender = _connect(worker, stop_at=3 if held_write else 0)
    worker.transfer_timeout_s = 30.0
    real_abort = worker.engine.abort

    def abort(rid):  # at each free: is the transfer over? (it ends under the lock writes hold)
        pt = worker.receiver._pending.get(tid)
        frees.append(pt is not None and not pt.done.is_set())
        return real_abort(rid)
    worker.engine.abort = abort
    rid = f"x{run}"
    try:
        desc = await worker.reserve(rid, PROMPT, PARAMS, 0, tid, layer_group_size=1)
        assert desc is not None and worker.requests[rid].state is DecodeState.RESERVED
        groups = list(enumerate(desc.layer_groups))
        sent = rng.randrange(len(groups) + 1)  # the prefill side may stop early (it died)
        blocks = list(desc.block_ids)
        for g, group in groups[:sent]:
            sender.submit(SendJob(tid, 1, blocks, group.layers, g, g == len(groups) - 1,
                                  dst_block_ids=blocks))
        end = rng.choice(ENDS)
        if sent < len(groups) and end == "none":
            end = "timeout"  # the KV will not all come: only a deadline ends it
        if end == "timeout":
            worker.transfer_timeout_s = 0.2
        req = DecodeRequest(rid, tuple(PROMPT), PARAMS, output_token_ids=(5,), descriptor=desc)
        stream = decode_stream(worker, req)
        reading = asyncio.ensure_future(_read(stream))
        await asyncio.sleep(rng.choice([0, 0.001, 0.02]))
        if end == "abort":
            await worker.abort(rid, rng.choice([None, tid]))
        elif end == "client gone":
            reading.cancel()
        if held_write:
            await asyncio.sleep(rng.choice([0, 0.01]))
            channel.gate.set()
        tokens, reason, error = await _settle(reading)
        if end == "none":
            assert error is None and len(tokens) == PARAMS.max_tokens - 1, (tokens, error)
        else:  # ended: with an error, or a finish (all its tokens, or cut by the abort)
            assert error is not None or reason is not None, (end, tokens)
        await asyncio.sleep(0)
    finally:
        channel.gate.set()
        worker.engine.abort = real_abort
        sender.close()


async def _read(stream) -> tuple[list[int], str | None]:
    """The tokens streamed, and the finish reason the stream ended with."""
    tokens, reason = [], None
    try:
        async for delta in stream:
            tokens += delta.token_ids
            reason = delta.finish_reason if delta.finished else reason
    finally:
        await stream.aclose()
    return tokens, reason


async def _settle(reading: asyncio.Future) -> tuple[list[int], str | None, BaseException | None]:
    try:
        return *(await asyncio.wait_for(reading, 60)), None
    except (TransferFailedError, asyncio.CancelledError, StopAsyncIteration) as e:
        return [], None, e


async def _until_free(worker) -> None:
    for _ in range(500):
        if _all_free(worker):
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("seed", range(3))
def test_random_orders_free_every_block_once_and_never_under_a_write(worker, seed):  # noqa: F811
    rng = random.Random(seed)
    frees: list[bool] = []

    async def main():
        for run in range(RUNS // 3):
            await _one_run(worker, rng, seed * 100 + run, frees)
            await _until_free(worker)
            assert _all_free(worker), (seed, run, worker.requests)
    asyncio.run(main())
    assert frees and not any(frees), "blocks freed while their transfer could still write"


def test_a_redrive_racing_its_own_release_holds_nothing_after(worker):  # noqa: F811
    channel, sender = _connect(worker)

    async def main():
        for run in range(8):
            rid = f"rr{run}"
            assert await worker.reserve(rid, PROMPT, PARAMS, 0, f"{rid}#0") is not None
            gate = threading.Event()
            worker.loop.submit(lambda e: gate.wait(30))  # the release's free waits behind this
            ending = asyncio.ensure_future(worker.abort(rid))
            redrive = asyncio.ensure_future(worker.reserve(rid, PROMPT, PARAMS, 0, f"{rid}#1"))
            if run % 2:
                asyncio.get_running_loop().call_later(0.01, gate.set)
                await asyncio.sleep(0.02)
                late_abort = asyncio.ensure_future(worker.abort(rid, f"{rid}#1"))
            else:
                gate.set()
                late_abort = None
            await ending
            with contextlib.suppress(TransferFailedError):
                if await redrive is not None and late_abort is None:
                    await worker.abort(rid, f"{rid}#1")
            if late_abort is not None:
                await late_abort
            await _until_free(worker)
            assert _all_free(worker), (run, worker.requests)
    asyncio.run(main())
    sender.close()
