"""The decode worker's one release path: whatever ends a remote-prefill request, its
transfer is aborted (no write in flight, later groups drained) before its blocks are
freed. A real DecodeWorker (tiny model, in process) over an in-process channel that
holds a receive back mid-write."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from contextlib import aclosing

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.protocol.request_path import DecodeRequest
from tandem.transfer.channel import ChannelBase
from tandem.transfer.endpoint import make_receiver
from tandem.transfer.sender import KVSender, SendJob
from tandem.transfer.device_sync import CpuSync
from tandem.decode.lifecycle import DecodeEvent as E
from tandem.decode.worker import TransferFailedError
from tests.decode_stream import decode_stream

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 40))


class Channel(ChannelBase):
    """Rank-to-rank byte queues; the receiver can be held before its ``stop_at``-th receive."""

    def __init__(self, rank: int, boxes: dict, stop_at: int = 0) -> None:
        super().__init__(rank, 2, [1 - rank], CpuSync(), 30.0)
        self._boxes = boxes
        self.stop_at, self.recvs = stop_at, 0
        self.gate, self.held = threading.Event(), threading.Event()

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self._boxes[(self.rank, dst_rank)].put(data.clone())

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self.recvs += 1
        if self.recvs == self.stop_at:
            self.held.set()
            assert self.gate.wait(30)
        buf.copy_(self._boxes[(src_rank, self.rank)].get(timeout=30))

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    from tandem.decode.worker import DecodeWorker

    w = DecodeWorker("decode-0", EngineConfig(model=str(tiny_model_dir),
                                              cache=CacheConfig(num_blocks=32)),
                     transfer_timeout_s=30.0)
    yield w
    w.shutdown()


def _connect(worker, stop_at: int = 0):
    boxes = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    channel = Channel(1, boxes, stop_at)
    worker.receiver, worker.rank = make_receiver(channel, worker.engine, [0]), 1
    c = worker.engine.kv_cache
    src = PagedKVCache(c.num_layers, c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim,
                       c.dtype, torch.device("cpu"))
    src.kv.normal_()
    sender = KVSender(Channel(0, boxes), src.gather, src.block_shape, src.dtype,
                      lambda r: None, src.plane, src.plane_block_bytes,
                      min_run_plane_bytes=1)  # in place: writes straight into the blocks
    return channel, sender


async def _close_feeds(worker) -> None:
    """Every open feed ends, as when its subscriber leaves."""
    for subscriber in list(worker.feeds._by_subscriber):
        await worker._drop_feed(subscriber)


def _all_free(worker) -> bool:
    e = worker.engine
    return (e.block_pool.num_free == e.block_pool.num_blocks and not e.scheduler.seqs
            and not worker.requests
            and not worker.receiver._pending)


def _record_frees(worker, channel, tid: str) -> list:
    """Record, at each engine abort, whether the transfer was finished and no write held."""
    seen, real = [], worker.engine.abort

    def abort(rid):
        pt = worker.receiver._pending.get(tid)
        seen.append((rid, pt is None or pt.done.is_set(), channel.gate.is_set() or not channel.stop_at))
        return real(rid)
    worker.engine.abort = abort
    return seen


def test_cancel_during_reserve_releases_the_reservation(worker):
    channel, sender = _connect(worker)

    async def main():
        gate = threading.Event()
        worker.loop.submit(lambda e: gate.wait(30))  # the reserve command queues behind this
        task = asyncio.ensure_future(worker.reserve("r1", PROMPT, PARAMS, 0, "r1#0"))
        await asyncio.sleep(0)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    assert _all_free(worker)
    sender.close()


@pytest.mark.parametrize("how", ["abort", "feed closed"])
def test_ending_a_request_mid_write_frees_its_blocks_only_after_the_write(worker, how):
    channel, sender = _connect(worker, stop_at=3)  # header, first plane, then held
    tid = f"r2#{how}"
    seen = _record_frees(worker, channel, tid)

    async def main():
        desc = await worker.reserve("r2", PROMPT, PARAMS, 0, tid, layer_group_size=1)
        blocks = list(desc.block_ids)
        for g, group in enumerate(desc.layer_groups):
            sender.submit(SendJob(tid, 1, blocks, group.layers, g, g == len(desc.layer_groups) - 1,
                                  dst_block_ids=blocks))
        req = DecodeRequest("r2", tuple(PROMPT), PARAMS, output_token_ids=(5,), descriptor=desc)
        stream = decode_stream(worker, req)
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(channel.held.wait, 30)  # a write into the blocks is in flight
        if how == "abort":
            ender = asyncio.ensure_future(worker.abort("r2"))
        else:  # the gateway went away: its feed closes, which ends the requests on it
            ender = asyncio.ensure_future(_close_feeds(worker))
        await asyncio.sleep(0.05)
        assert not seen, "blocks freed while a write into them was in flight"
        channel.gate.set()
        from tandem.decode.worker import TransferFailedError

        with contextlib.suppress(asyncio.CancelledError):
            await ender

        with pytest.raises((StopAsyncIteration, asyncio.CancelledError, TransferFailedError)):
            await waiting
        await stream.aclose()
    asyncio.run(main())
    assert seen and all(finished and written for _, finished, written in seen), seen
    worker.engine.abort = type(worker.engine).abort.__get__(worker.engine)
    assert _all_free(worker)
    sender.close()


def test_a_transfer_that_times_out_releases_and_a_redrive_of_the_same_id_works(worker):
    channel, sender = _connect(worker)
    worker.transfer_timeout_s = 0.2

    async def main():
        from tandem.decode.worker import TransferFailedError

        desc = await worker.reserve("r3", PROMPT, PARAMS, 0, "r3#0")
        req = DecodeRequest("r3", tuple(PROMPT), PARAMS, output_token_ids=(5,), descriptor=desc)
        with pytest.raises(TransferFailedError, match="FAILED"):
            async with aclosing(decode_stream(worker, req)) as stream:
                async for _ in stream:
                    pass
        # the same request re-driven to this worker, its KV arriving this time
        worker.transfer_timeout_s = 30.0
        desc = await worker.reserve("r3", PROMPT, PARAMS, 0, "r3#1")
        blocks = list(desc.block_ids)
        for g, group in enumerate(desc.layer_groups):
            sender.submit(SendJob("r3#1", 1, blocks, group.layers, g,
                                  g == len(desc.layer_groups) - 1, dst_block_ids=blocks))
        req = DecodeRequest("r3", tuple(PROMPT), PARAMS, output_token_ids=(5,), descriptor=desc)
        tokens = []
        async with aclosing(decode_stream(worker, req)) as stream:
            async for delta in stream:
                tokens += delta.token_ids
        return tokens
    tokens = asyncio.run(main())
    assert len(tokens) == PARAMS.max_tokens - 1
    assert _all_free(worker)
    assert worker.receiver._pending == {}
    sender.close()


async def _redrive_waiting_for_release(worker, rid: str, then) -> tuple[asyncio.Future, asyncio.Future]:
    """Attempt 0 of ``rid`` reserved, then being released (its engine abort queued behind a
    held step) when the same id is re-driven here; ``then()`` runs while the re-drive waits,
    then the step is let go. Returns the re-drive's reserve and ``then``'s future."""
    assert await worker.reserve(rid, PROMPT, PARAMS, 0, f"{rid}#0") is not None
    gate = threading.Event()
    worker.loop.submit(lambda e: gate.wait(30))
    first = asyncio.ensure_future(worker.abort(rid))
    await asyncio.sleep(0.05)
    redrive = asyncio.ensure_future(worker.reserve(rid, PROMPT, PARAMS, 0, f"{rid}#1"))
    await asyncio.sleep(0.05)
    during = asyncio.ensure_future(then())
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.gather(first, during)
    return redrive, during


def test_an_abort_during_a_redrives_wait_for_the_earlier_release_ends_the_redrive_too(worker):
    # the gateway leaves while the re-drive waits, and its abort finds the earlier release
    # still running: the re-drive must not reserve blocks nobody frees
    channel, sender = _connect(worker)

    async def main():
        redrive, _ = await _redrive_waiting_for_release(worker, "r1", lambda: worker.abort("r1"))
        with pytest.raises(TransferFailedError, match="before its reservation"):
            await redrive
    asyncio.run(main())
    assert _all_free(worker)
    sender.close()


def test_the_earlier_attempts_own_end_does_not_end_a_waiting_redrive(worker):
    # the earlier attempt ending itself (its start failing, its feed dropped) while the
    # re-drive waits: the re-drive reserves once that release is done
    channel, sender = _connect(worker)

    async def main():
        redrive, _ = await _redrive_waiting_for_release(worker, "r2", lambda: asyncio.shield(worker._end("r2", E.STREAM_CLOSED)))
        assert (await redrive) is not None
        await worker.abort("r2")
    asyncio.run(main())
    assert _all_free(worker)
    sender.close()


def test_a_reserve_that_arrives_after_its_own_abort_is_refused_and_holds_nothing(worker):
    # the driver cancelled while its reserve call was in flight and aborted the attempt;
    # the async actor ran the abort first: the late reserve must not take blocks
    channel, sender = _connect(worker)

    async def main():
        await worker.abort("r4", "r4#0.ab")
        with pytest.raises(TransferFailedError, match="aborted on decode-0 before"):
            await worker.reserve("r4", PROMPT, PARAMS, 0, "r4#0.ab")
        assert _all_free(worker)
        # the abort named that attempt only: a re-drive of the id reserves as usual
        assert await worker.reserve("r4", PROMPT, PARAMS, 0, "r4#1.cd") is not None
        await worker.abort("r4", "r4#1.cd")
    asyncio.run(main())
    assert _all_free(worker)
    # a tombstone is used once, and an abort of a reservation made here leaves none
    assert not worker._aborted_transfers
    sender.close()
