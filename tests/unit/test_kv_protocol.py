"""The KV protocol's sender and receiver over an in-process channel: bytes land in the
right blocks by either layout, and a stream stays aligned after anything goes wrong."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.protocol.messages import TransferStatus
from tandem.transfer.channel import ChannelBase
from tandem.transfer.layout import MIN_RUN_PLANE_BYTES
from tandem.transfer.receiver import KVReceiver
from tandem.transfer.sender import KVSender, SendJob
from tandem.transfer.device_sync import CpuSync

LAYERS, BLOCK, KVH, DIM = 4, 16, 8, 64  # one block plane = 32 KiB


class PairChannel(ChannelBase):
    """Rank-to-rank byte queues with the KVChannel contract (exact-size receives)."""

    def __init__(self, rank: int, boxes: dict) -> None:
        super().__init__(rank, 4, [p for p in range(4) if p != rank], CpuSync(), 30.0)
        self._boxes = boxes
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


# -- orderings under faults: a channel that holds messages back, fails, or misdirects --------

class GatedChannel(PairChannel):
    """A PairChannel whose receiver stops before its ``n``-th receive until ``gate`` opens
    (a write in flight, held there by the test)."""

    def __init__(self, rank: int, boxes: dict, stop_at: int) -> None:
        super().__init__(rank, boxes)
        self.stop_at, self.recvs = stop_at, 0
        self.gate, self.held = threading.Event(), threading.Event()

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self.recvs += 1
        if self.recvs == self.stop_at:
            self.held.set()
            assert self.gate.wait(10)
        super().recv(buf, src_rank, idle)


def _endpoints(recv_channel, peers=(0,), send_rank=0, boxes=None):
    src = PagedKVCache(LAYERS, 64, BLOCK, KVH, DIM, torch.float32, torch.device("cpu"))
    dst = PagedKVCache(LAYERS, 64, BLOCK, KVH, DIM, torch.float32, torch.device("cpu"))
    src.kv.normal_()
    sender = KVSender(PairChannel(send_rank, boxes), src.gather, src.block_shape, src.dtype,
                      lambda r: None, src.plane, src.plane_block_bytes)
    receiver = KVReceiver(recv_channel, list(peers), dst.scatter, dst.block_shape, dst.dtype,
                          dst.plane, dst.plane_block_bytes)
    return src, dst, sender, receiver


def test_abort_during_an_in_place_write_returns_after_it_and_late_groups_are_drained():
    boxes = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    gated = GatedChannel(1, boxes, stop_at=3)  # header, first plane, then held mid-group
    src, dst, sender, receiver = _endpoints(gated, boxes=boxes)
    groups = [range(0, 2), range(2, 4)]
    blocks = list(range(16))
    receiver.expect("old", 0, blocks, groups)
    sender.submit(SendJob("old", 1, blocks, groups[0], 0, False, dst_block_ids=blocks))
    assert gated.held.wait(10)
    aborted = threading.Event()
    aborter = threading.Thread(target=lambda: (receiver.abort("old"), aborted.set()))
    aborter.start()
    aborter.join(0.3)
    assert not aborted.is_set(), "abort returned while a write into the blocks was in flight"
    gated.gate.set()
    aborter.join(10)
    assert aborted.is_set()
    receiver.forget("old")
    # the blocks now belong to another request, whose KV lands in them ...
    new_src = list(range(32, 48))
    pt = _transfer(sender, receiver, "new", new_src, blocks, groups)
    assert pt.status == TransferStatus.DONE, pt.error
    # ... and then the old transfer's late group arrives: drained, never written
    sender.submit(SendJob("old", 1, blocks, groups[1], 1, True, dst_block_ids=blocks))
    probe = _transfer(sender, receiver, "probe", list(range(16)), list(range(50, 58)) +
                      list(range(20, 28)), groups)
    assert probe.status == TransferStatus.DONE, probe.error
    _assert_copied(src, dst, new_src, blocks)
    sender.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
def test_groups_of_an_aborted_transfer_arriving_after_the_blocks_were_reused_are_dropped(
        pair, in_place):
    src, dst, sender, receiver, _, _ = pair
    groups = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    blocks = list(range(16))
    receiver.expect("late", 0, blocks, groups)
    sender.submit(SendJob("late", 1, list(range(40, 56)), groups[0], 0, False,
                          dst_block_ids=blocks if in_place else ()))
    receiver.abort("late")
    receiver.forget("late")
    reused = _transfer(sender, receiver, "reuse", list(range(16)), blocks, groups, in_place)
    assert reused.status == TransferStatus.DONE, reused.error
    for g in range(1, 4):  # the rest of the abandoned transfer, out of order and late
        sender.submit(SendJob("late", 1, list(range(40, 56)), groups[g], g, g == 3,
                              dst_block_ids=blocks if in_place else ()))
    tail = _transfer(sender, receiver, "tail", list(range(20, 24)), list(range(60, 64)), groups,
                     in_place)
    assert tail.status == TransferStatus.DONE, tail.error
    _assert_copied(src, dst, range(16), blocks)


def test_a_group_from_the_wrong_rank_fails_its_transfer_and_both_streams_go_on():
    boxes = {(0, 1): queue.Queue(), (2, 1): queue.Queue(), (1, 0): queue.Queue(),
             (1, 2): queue.Queue()}
    recv_ch = PairChannel(1, boxes)
    src, dst, right, receiver = _endpoints(recv_ch, peers=(0, 2), send_rank=0, boxes=boxes)
    wrong = KVSender(PairChannel(2, boxes), src.gather, src.block_shape, src.dtype,
                     lambda r: None, src.plane, src.plane_block_bytes)
    groups = [range(0, LAYERS)]
    for sender, in_place in ((wrong, True), (wrong, False)):
        tid = f"misdirected-{in_place}"
        receiver.expect(tid, 0, list(range(16)), groups)  # expected from rank 0
        sender.submit(SendJob(tid, 1, list(range(16)), groups[0], 0, True,
                              dst_block_ids=list(range(16)) if in_place else ()))
        pt = receiver.wait(tid, 10)
        assert pt.status == TransferStatus.FAILED and "from rank 2" in pt.error
        receiver.forget(tid)
    assert not dst.kv.any(), "misdirected KV must not be written"
    for sender, tid in ((right, "ok-0"), (wrong, "ok-2")):
        receiver.expect(tid, sender.channel.rank, list(range(16, 32)), groups)
        sender.submit(SendJob(tid, 1, list(range(16)), groups[0], 0, True))
        assert receiver.wait(tid, 10).status == TransferStatus.DONE
        receiver.forget(tid)
    assert receiver.broken is None
    right.close()
    wrong.close()


def test_a_payload_of_the_wrong_size_fails_its_transfer_without_misaligning_the_stream(pair):
    src, dst, sender, receiver, _, _ = pair
    groups = [range(0, LAYERS)]
    receiver.expect("short", 0, list(range(16)), groups)
    sender.submit(SendJob("short", 1, list(range(8)), groups[0], 0, True))  # 8 of 16 blocks
    pt = receiver.wait("short", 10)
    assert pt.status == TransferStatus.FAILED and "expected" in pt.error
    receiver.forget("short")
    ok = _transfer(sender, receiver, "after", list(range(16)), list(range(16, 32)), groups)
    assert ok.status == TransferStatus.DONE, ok.error
    assert receiver.broken is None


def test_a_write_that_raises_fails_only_its_transfer(pair):
    src, dst, sender, receiver, _, _ = pair
    groups = [range(0, LAYERS)]
    real, calls = receiver._scatter, []

    def scatter(block_ids, layers, data):
        calls.append(list(block_ids))
        if len(calls) == 1:
            raise RuntimeError("bad payload")
        real(block_ids, layers, data)
    receiver._scatter = scatter
    pt = _transfer(sender, receiver, "boom", list(range(16)), list(range(16)), groups, False)
    assert pt.status == TransferStatus.FAILED and "bad payload" in pt.error
    ok = _transfer(sender, receiver, "fine", list(range(16)), list(range(16, 32)), groups, False)
    assert ok.status == TransferStatus.DONE, ok.error


class BrokenChannel(PairChannel):
    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self.broken = "recv timed out"
        raise RuntimeError("Application timeout caused pair closure")


def test_a_failed_receive_breaks_the_receiver_fails_its_transfers_and_refuses_new_ones():
    boxes = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    gated = GatedChannel(1, boxes, stop_at=1)
    src, dst, sender, receiver = _endpoints(gated, boxes=boxes)
    receiver.expect("inflight", 0, list(range(16)), [range(0, LAYERS)])
    assert gated.held.wait(10)
    gated.broken = "recv timed out"  # what a timed-out gloo recv leaves behind
    boxes[(0, 1)].put(torch.zeros(3, dtype=torch.uint8))  # and a receive that fails
    gated.gate.set()
    pt = receiver.wait("inflight", 10)
    assert pt.status == TransferStatus.FAILED and "rank 0 lost" in pt.error
    assert receiver.broken is not None
    with pytest.raises(ConnectionError):
        receiver.expect("next", 0, list(range(16)), [range(0, LAYERS)])
    sender.close()


def test_the_watchdog_tears_down_a_call_past_its_deadline_and_spares_the_others():
    from tandem.transfer.watchdog import Watchdog

    released = threading.Event()
    dog = Watchdog(lambda what: released.set())
    with dog.guard("quick send", 30.0):
        pass
    with dog.guard("idle recv", None):
        pass
    assert dog.expired is None and not released.is_set()
    with pytest.raises(TimeoutError):
        with dog.guard("recv from rank 0", 0.05):
            if released.wait(10):  # a blocking NCCL call, freed when the group is torn down
                raise TimeoutError("communicator aborted")
    assert dog.expired == "recv from rank 0"
    dog.close()
