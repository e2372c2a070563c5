"""Heartbeats: an idle sender keeps each pair busy with empty headers the receiver skips
(transfers before and after are unaffected), and a receiver that is gone shows at the
next heartbeat as a broken channel instead of at the next request."""

from __future__ import annotations

import queue
import threading

import torch

from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.protocol.payload import HEADER_BYTES, decode_header
from tandem.transfer.channel import ChannelBase
from tandem.transfer.receiver import KVReceiver
from tandem.transfer.sender import HEARTBEAT_ID, KVSender, SendJob
from tandem.transfer.device_sync import CpuSync


class QueueChannel(ChannelBase):
    def __init__(self, rank: int, boxes: dict, dead: threading.Event | None = None) -> None:
        super().__init__(rank, 2, [1 - rank], CpuSync(), 30.0)
        self._boxes, self._dead = boxes, dead
        self.headers: list[str] = []

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        if self._dead is not None and self._dead.is_set():
            self.broken = "send to rank 1: peer gone"
            raise ConnectionError(self.broken)
        if data.numel() == HEADER_BYTES:
            self.headers.append(decode_header(data.numpy().tobytes()).transfer_id)
        self._boxes[(self.rank, dst_rank)].put(data.clone())

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        buf.copy_(self._boxes[(src_rank, self.rank)].get(timeout=30))


def _wait(condition) -> None:
    pause = threading.Event()
    for _ in range(2000):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError("the condition never held")


def test_idle_pairs_get_heartbeats_that_the_receiver_skips():
    boxes = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    src = PagedKVCache(2, 8, 16, 2, 16, torch.float32, torch.device("cpu"))
    dst = PagedKVCache(2, 8, 16, 2, 16, torch.float32, torch.device("cpu"))
    src.kv.normal_()
    send_ch = QueueChannel(0, boxes)
    sender = KVSender(send_ch, src.gather, src.block_shape, src.dtype, lambda r: None,
                      heartbeat_s=0.02)
    receiver = KVReceiver(QueueChannel(1, boxes), [0], dst.scatter, dst.block_shape, dst.dtype)
    try:
        _wait(lambda: sender.heartbeats >= 3)
        receiver.expect("t", 0, [4, 5], [range(0, 2)])
        sender.submit(SendJob("t", 1, [1, 2], range(0, 2), 0, True))
        assert receiver.wait("t", 30).status.name == "DONE"
        assert torch.equal(dst.kv[:, :, [4, 5]], src.kv[:, :, [1, 2]])
        _wait(lambda: send_ch.headers[-1] == HEARTBEAT_ID and send_ch.headers.count("t") == 1)
        assert receiver.broken is None
    finally:
        sender.close()


def test_a_heartbeat_to_a_receiver_that_is_gone_breaks_the_channel():
    boxes = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    src = PagedKVCache(2, 8, 16, 2, 16, torch.float32, torch.device("cpu"))
    dead = threading.Event()
    send_ch = QueueChannel(0, boxes, dead)
    sender = KVSender(send_ch, src.gather, src.block_shape, src.dtype, lambda r: None,
                      heartbeat_s=0.02)
    try:
        dead.set()
        _wait(lambda: send_ch.broken is not None)
        assert "peer gone" in send_ch.broken
    finally:
        sender.close()
