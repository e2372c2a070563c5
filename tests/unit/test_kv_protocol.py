"""The KV protocol's sender and receiver over an in-process channel: bytes land in the
right blocks by either layout, and a stream stays aligned after anything goes wrong."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from services.engine.kv_cache.paged_cache import PagedKVCache
from services.protocol.messages import TransferStatus
from services.transfer.layout import MIN_RUN_PLANE_BYTES
from services.transfer.receiver import KVReceiver
from services.transfer.sender import KVSender, SendJob

LAYERS, BLOCK, KVH, DIM = 4, 16, 8, 64  # one block plane = 32 KiB


class PairChannel:
    """Rank-to-rank byte queues with the KVChannel contract (exact-size receives)."""

    def __init__(self, rank: int, boxes: dict) -> None:
        self.rank, self.world_size, self.device, self._boxes = rank, 2, torch.device("cpu"), boxes
        self.broken: str | None = None
        self.messages_sent = 0

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        assert data.is_contiguous() and data.dtype == torch.uint8
        self._boxes[(self.rank, dst_rank)].put(data.clone())
        self.messages_sent += 1

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        data = self._boxes[(src_rank, self.rank)].get(timeout=10)
        assert data.numel() == buf.numel(), f"message of {data.numel()} bytes into {buf.numel()}"
        buf.copy_(data)

    def close(self) -> None:
        pass


@pytest.fixture
def pair():
    boxes = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    src = PagedKVCache(LAYERS, 64, BLOCK, KVH, DIM, torch.float32, torch.device("cpu"))
    dst = PagedKVCache(LAYERS, 64, BLOCK, KVH, DIM, torch.float32, torch.device("cpu"))
    src.kv.normal_()
    reports, done = [], threading.Event()

    def on_done(r):
        reports.append(r)
        done.set()
    send_ch, recv_ch = PairChannel(0, boxes), PairChannel(1, boxes)
    sender = KVSender(send_ch, src.gather, src.block_shape, src.dtype, on_done, src.plane,
                      src.plane_block_bytes)
    receiver = KVReceiver(recv_ch, [0], dst.scatter, dst.block_shape, dst.dtype, dst.plane,
                          dst.plane_block_bytes)
    yield src, dst, sender, receiver, send_ch, reports
    sender.close()


def _transfer(sender, receiver, tid, src_blocks, dst_blocks, groups, in_place=True,
              expect=True, **job):
    if expect:
        receiver.expect(tid, 0, dst_blocks, groups)
    for g, layers in enumerate(groups):
        sender.submit(SendJob(tid, 1, src_blocks, layers, g, g == len(groups) - 1,
                              dst_block_ids=dst_blocks if in_place else (), **job))
    if expect:
        pt = receiver.wait(tid, 10)
        receiver.forget(tid)
        return pt


def _assert_copied(src, dst, src_blocks, dst_blocks):
    for s, d in zip(src_blocks, dst_blocks):
        assert torch.equal(dst.kv[:, :, d], src.kv[:, :, s]), f"block {s} -> {d}"


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
def test_blocks_arrive_intact_by_either_layout(pair, in_place):
    src, dst, sender, receiver, ch, _ = pair
    assert src.plane_block_bytes * 8 >= MIN_RUN_PLANE_BYTES
    src_blocks, dst_blocks = list(range(3, 19)), list(range(40, 48)) + list(range(10, 18))
    groups = [range(0, 2), range(2, 4)]
    pt = _transfer(sender, receiver, "t1", src_blocks, dst_blocks, groups, in_place)
    assert pt.status == TransferStatus.DONE, pt.error
    assert pt.num_bytes == len(src_blocks) * src.bytes_per_block(LAYERS, BLOCK, KVH, DIM,
                                                                  torch.float32)
    _assert_copied(src, dst, src_blocks, dst_blocks)
    # in place: per group a header, then 2 layers x K|V x 2 runs; gathered: header + payload
    assert ch.messages_sent == 2 * (1 + (2 * 2 * 2 if in_place else 1))


def test_an_unknown_in_place_transfer_is_drained_and_the_next_one_lands(pair):
    src, dst, sender, receiver, _, reports = pair
    groups = [range(0, LAYERS)]
    _transfer(sender, receiver, "ghost", list(range(16)), list(range(16)), groups, expect=False)
    pt = _transfer(sender, receiver, "real", list(range(20, 36)), list(range(30, 46)), groups)
    assert pt.status == TransferStatus.DONE, pt.error
    _assert_copied(src, dst, range(20, 36), range(30, 46))
    assert not dst.kv[:, :, :16].any(), "a drained payload must not be written anywhere"


def test_runs_that_do_not_fit_the_reservation_fail_without_breaking_the_stream(pair):
    src, dst, sender, receiver, _, _ = pair
    groups = [range(0, LAYERS)]
    receiver.expect("bad", 0, list(range(50, 58)) + list(range(0, 8)), groups)
    # the sender was told other destination blocks than the receiver reserved
    sender.submit(SendJob("bad", 1, list(range(16)), groups[0], 0, True,
                          dst_block_ids=list(range(16))))
    pt = receiver.wait("bad", 10)
    assert pt.status == TransferStatus.FAILED and "do not fit" in pt.error
    receiver.forget("bad")
    assert not dst.kv.any()
    ok = _transfer(sender, receiver, "next", list(range(16, 32)), list(range(16, 32)), groups)
    assert ok.status == TransferStatus.DONE, ok.error


def test_an_aborted_transfer_is_not_written_after_abort_returns(pair):
    src, dst, sender, receiver, _, _ = pair
    groups = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    receiver.expect("gone", 0, list(range(16)), groups)
    receiver.abort("gone")
    for g, layers in enumerate(groups):
        sender.submit(SendJob("gone", 1, list(range(16)), layers, g, g == 3,
                              dst_block_ids=list(range(16))))
    ok = _transfer(sender, receiver, "after", list(range(16)), list(range(32, 48)), groups)
    assert ok.status == TransferStatus.DONE, ok.error
    assert not dst.kv[:, :, :16].any()


def test_checksummed_transfers_are_gathered_and_verified(pair):
    src, dst, sender, receiver, ch, _ = pair
    pt = _transfer(sender, receiver, "crc", list(range(16)), list(range(16)),
                   [range(0, LAYERS)], with_checksum=True)
    assert pt.status == TransferStatus.DONE, pt.error
    assert ch.messages_sent == 2
    _assert_copied(src, dst, range(16), range(16))
