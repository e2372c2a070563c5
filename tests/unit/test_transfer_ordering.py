"""The device order of KV transfer, checked on CPU with the recording fake of DeviceSync.

Real prefill and decode workers (tiny model, in process) over an in-process channel
that logs every send and receive with the stream it was queued on, next to the
fake's records and waits of events: each layer group is sent after its layer's
compute event, on the pair's own stream; the decode step waits for the last
write's event before it reads the blocks; blocks are freed (prefill) and
transfers end (decode) only once the device work completed; two prefill peers
never wait on each other's streams.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
import torch

from tandem.common.config import CacheConfig, EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.protocol.payload import HEADER_BYTES, decode_header
from tandem.protocol.request_path import DecodeRequest, PrefillRequest
from tandem.transfer.channel import ChannelBase
from tandem.transfer.endpoint import make_receiver, make_sender
from tandem.transfer.device_sync import RecordingSync
from tests.decode_stream import decode_stream

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = tuple(range(3, 40))


class RecordingChannel(ChannelBase):
    """Rank-to-rank byte queues; each send/recv logged as ``(op, stream, what...)``."""

    def __init__(self, rank: int, peers: list[int], boxes: dict, sync: RecordingSync) -> None:
        super().__init__(rank, 4, peers, sync, 30.0)
        self._boxes = boxes

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self.sync.note("send", self.sync.current_stream(), *_what(data))
        self._boxes[(self.rank, dst_rank)].put(data.clone())

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        data = self._boxes[(src_rank, self.rank)].get(timeout=30)
        buf.copy_(data)
        self.sync.note("recv", self.sync.current_stream(), *_what(data))


def _what(data: torch.Tensor) -> tuple:
    if data.numel() == HEADER_BYTES:
        h = decode_header(data.numpy().tobytes())
        return ("header", h.transfer_id, h.layer_group)
    return ("bytes", data.numel())


def _boxes(*pairs) -> dict:
    return {pair: queue.Queue() for a, b in pairs for pair in ((a, b), (b, a))}


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    """A prefill worker (rank 0) whose events stay pending until completed, and a decode
    worker (rank 1) with a prefill peer, sharing one log."""
    from tandem.decode.worker import DecodeWorker
    from tandem.prefill.worker import PrefillWorker

    class LoggedPrefill(PrefillWorker):
        def _on_layer_done(self, layer, completing):
            if completing:
                self.sync.note("compute", self.sync.current_stream(), layer)
            super()._on_layer_done(layer, completing)

    log: list = []
    p_sync = RecordingSync(log, hold=True, label="P:")
    d_sync = RecordingSync(log, label="D:", first_id=10_000)
    cfg = EngineConfig(model=str(tiny_model_dir), cache=CacheConfig(num_blocks=32))
    prefill = LoggedPrefill("prefill-0", cfg, sync=p_sync)
    decode = DecodeWorker("decode-0", cfg, sync=d_sync)
    step = decode.engine.step

    def logged_step(*a, **kw):
        if decode.engine.scheduler.running:
            d_sync.note("step", d_sync.current_stream())
        return step(*a, **kw)
    decode.engine.step = logged_step
    boxes = _boxes((0, 1))
    prefill.sender = make_sender(RecordingChannel(0, [1], boxes, p_sync), prefill.engine,
                                 prefill._on_sent, min_run_plane_bytes=1)
    decode.receiver = make_receiver(RecordingChannel(1, [0], boxes, d_sync), decode.engine, [0])
    decode.rank = 1
    yield prefill, decode, log, p_sync
    prefill.shutdown()
    decode.shutdown()


def _at(log: list, entry: tuple, start: int = 0) -> int:
    for i in range(start, len(log)):
        if log[i][:len(entry)] == entry:
            return i
    raise AssertionError(f"{entry} not in the log after {start}: {log[start:start + 40]}")


def _run(prefill, decode, rid: str, group_size: int, on_first=None) -> list[int]:
    async def main():
        desc = await decode.reserve(rid, PROMPT, PARAMS, 0, f"{rid}#t", layer_group_size=group_size)
        first = await prefill.prefill(PrefillRequest(rid, PROMPT, PARAMS, desc))
        if on_first is not None:
            await asyncio.to_thread(on_first, desc)
        req = DecodeRequest(rid, PROMPT, PARAMS, output_token_ids=(first.first_token_id,),
                            descriptor=desc)
        tokens = [first.first_token_id]
        async for delta in decode_stream(decode, req):
            tokens.extend(delta.token_ids)
        return desc, tokens
    return asyncio.run(main())


def test_a_full_transfer_is_ordered_by_events_from_compute_to_decode(workers, tiny_model_dir):
    from tandem.engine import LLM

    prefill, decode, log, p_sync = workers
    held = {}

    def before_release(desc):  # token #1 is out and the last send queued (its completion
        # event recorded, pending on the fake device): nothing may be freed yet
        _wait_for(lambda: sum(e[:2] == ("record", "P:kv-0-1") for e in list(log)) >= 2)
        held["kept"] = "ord-1" in prefill.engine.scheduler.prefilled
        p_sync.complete()  # the device finishes the compute and the sends

    desc, tokens = _run(prefill, decode, "ord-1", 1, before_release)
    reference = LLM(str(tiny_model_dir), num_blocks=32).generate([list(PROMPT)], PARAMS)
    assert tokens == reference[0].outputs[0].token_ids
    assert held["kept"], "prefill blocks freed before their sends completed on the device"

    n_groups = len(desc.layer_groups)
    assert n_groups > 1
    # computes follow one another on the engine thread and sends on the sender's, which
    # may trail: the next layer's compute can come before this group's send
    compute_from = send_from = 0
    for g, group in enumerate(desc.layer_groups):
        last = group.layers.stop - 1
        # compute of the group's last layer -> event on the compute stream -> the pair's
        # stream waits for it -> the group's header and payload go out on that stream
        c = _at(log, ("compute", "P:compute", last), compute_from)
        rec = log[_at(log, ("record", "P:compute"), c)]  # only the engine thread records here
        assert not any(e[:2] == ("compute", "P:compute") for e in log[c + 1:log.index(rec)])
        w = _at(log, ("wait", "P:kv-0-1", rec[2]), c)
        s = _at(log, ("send", "P:kv-0-1", "header", "ord-1#t", g), max(w, send_from))
        compute_from, send_from = c + 1, s + 1
    # the transfer's completion event is recorded after the last send, and the blocks
    # are freed only after the fake device completed it
    last_send = max(i for i, e in enumerate(log) if e[:2] == ("send", "P:kv-0-1"))
    end = _at(log, ("record", "P:kv-0-1"), last_send)
    _at(log, ("done", log[end][2]), end)
    assert "ord-1" not in prefill.engine.scheduler.prefilled

    # decode: the reservation is an event on the compute stream, and the pair's stream
    # waits for it before the first bytes land in the blocks
    reserved = log[_at(log, ("record", "D:compute"))]
    first_bytes = _at(log, ("recv", "D:kv-1-0", "bytes"))
    assert _at(log, ("wait", "D:kv-1-0", reserved[2])) < first_bytes
    # the last group's payload lands, an event is recorded on the pair's stream,
    # the compute stream waits for it, and only then does a step read the blocks
    last_recv = max(i for i, e in enumerate(log) if e[:2] == ("recv", "D:kv-1-0")
                    and e[2] == "bytes")
    ready = _at(log, ("record", "D:kv-1-0"), last_recv)
    wait = _at(log, ("wait", "D:compute", log[ready][2]), ready)
    _at(log, ("step", "D:compute"), wait)
    assert not any(e[:2] == ("step", "D:compute") for e in log[:wait] if e[0] == "step")
    assert all(e[1].startswith("P:kv") for e in log if e[0] == "send")
    assert all(e[1] == "D:kv-1-0" for e in log if e[0] == "recv")


def test_an_aborted_transfer_frees_its_blocks_only_after_its_writes_completed(tiny_model_dir):
    from tandem.decode.worker import DecodeWorker

    log: list = []
    # held: the events that mark KV written (timing events), not the header arrivals
    d_sync = RecordingSync(log, hold=lambda e: e.timing, label="D:")
    p_sync = RecordingSync(log, label="P:", first_id=10_000)
    decode = DecodeWorker("decode-1", EngineConfig(model=str(tiny_model_dir),
                                                   cache=CacheConfig(num_blocks=32)), sync=d_sync)
    boxes = _boxes((0, 1))
    decode.receiver = make_receiver(RecordingChannel(1, [0], boxes, d_sync), decode.engine, [0])
    decode.rank = 1
    src = decode.engine.kv_cache
    from tandem.transfer.sender import KVSender, SendJob

    sender = KVSender(RecordingChannel(0, [1], boxes, p_sync), src.gather, src.block_shape,
                      src.dtype, lambda r: None, src.plane, src.plane_block_bytes, 1)
    real_abort = decode.engine.abort

    def abort(rid):
        d_sync.note("free", rid)
        return real_abort(rid)
    decode.engine.abort = abort
    try:
        async def main():
            desc = await decode.reserve("ab-1", PROMPT, PARAMS, 0, "ab-1#t", layer_group_size=1)
            blocks = list(desc.block_ids)
            sender.submit(SendJob("ab-1#t", 1, blocks, desc.layer_groups[0].layers, 0, False,
                                  dst_block_ids=blocks))
            # the first group's write is queued and its completion pending on the fake device
            await asyncio.to_thread(_wait_for, lambda: any(
                not e.done and e.stream == "D:kv-1-0" for e in d_sync.events))
            ending = asyncio.ensure_future(decode.abort("ab-1"))
            await asyncio.sleep(0)
            assert not ending.done()
            pending = [e for e in d_sync.events if not e.done]
            d_sync.note("device finishes")
            d_sync.complete()
            await ending
            for g, group in enumerate(desc.layer_groups[1:], start=1):  # late groups: drained
                sender.submit(SendJob("ab-1#t", 1, blocks, group.layers, g,
                                      g == len(desc.layer_groups) - 1, dst_block_ids=blocks))
            return pending
        pending = asyncio.run(main())
        assert pending
        finish = _at(log, ("device finishes",))
        free = _at(log, ("free", "ab-1"))
        assert finish < free, "blocks freed while a write into them was still on the device"
        e = decode.engine
        assert e.block_pool.num_free == e.block_pool.num_blocks
    finally:
        sender.close()
        decode.shutdown()


def _wait_for(condition) -> None:
    pause = threading.Event()
    for _ in range(3000):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError("the condition never held")


def test_two_prefill_peers_never_wait_on_each_others_streams(tiny_model_dir):
    """Peer 2 completes a transfer while a receive for idle peer 0 is posted; each peer's
    receives, events and host waits stay on that peer's own stream."""
    from tandem.engine.kv_cache.paged_cache import PagedKVCache
    from tandem.transfer.receiver import KVReceiver
    from tandem.transfer.sender import KVSender, SendJob

    log: list = []
    sync = RecordingSync(log, label="D:")
    boxes = _boxes((0, 1), (2, 1))
    dst = PagedKVCache(4, 32, 16, 2, 8, torch.float32, torch.device("cpu"))
    receiver = KVReceiver(RecordingChannel(1, [0, 2], boxes, sync), [0, 2], dst.scatter,
                          dst.block_shape, dst.dtype, dst.plane, dst.plane_block_bytes)
    srcs, senders = {}, {}
    for rank, first_id in ((0, 10_000), (2, 20_000)):
        src = srcs[rank] = PagedKVCache(4, 32, 16, 2, 8, torch.float32, torch.device("cpu"))
        src.kv.normal_()
        senders[rank] = KVSender(RecordingChannel(rank, [1], boxes,
                                                  RecordingSync(log, label=f"P{rank}:",
                                                                first_id=first_id)),
                                 src.gather, src.block_shape, src.dtype, lambda r: None)
    groups = [range(0, 2), range(2, 4)]
    try:
        receiver.expect("from-2", 2, [5, 6, 7], groups)
        for g, layers in enumerate(groups):
            senders[2].submit(SendJob("from-2", 1, [1, 2, 3], layers, g, g == 1))
        pt = receiver.wait("from-2", 30)  # peer 0 has sent nothing: its receive stays posted
        assert pt.status.name == "DONE", pt.error
        assert torch.equal(dst.kv[:, :, [5, 6, 7]], srcs[2].kv[:, :, [1, 2, 3]])
        receiver.expect("from-0", 0, [9, 10], groups)
        for g, layers in enumerate(groups):
            senders[0].submit(SendJob("from-0", 1, [4, 8], layers, g, g == 1))
        assert receiver.wait("from-0", 30).status.name == "DONE"
        assert torch.equal(dst.kv[:, :, [9, 10]], srcs[0].kv[:, :, [4, 8]])
    finally:
        for s in senders.values():
            s.close()
    streams = {e[2]: e[1] for e in log if e[0] == "record" and e[1].startswith("D:")}
    for e in log:
        if e[0] == "recv":
            peer = {"from-0": 0, "from-2": 2}.get(e[3]) if e[2] == "header" else None
            if peer is not None:
                assert e[1] == f"D:kv-1-{peer}", e
    # every event the receiver recorded is on a pair stream, never a shared one
    assert set(streams.values()) <= {"D:kv-1-0", "D:kv-1-2"}, set(streams.values())
    assert {"D:kv-1-0", "D:kv-1-2"} <= set(streams.values())
