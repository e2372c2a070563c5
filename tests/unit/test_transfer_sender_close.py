"""Closing a sender (its group is rebuilt) never strands a transfer: every final job
submitted is reported exactly once, whether its send outlasts ``close``'s wait or the
job is submitted while ``close`` runs. A transfer never reported keeps its prompt's
KV blocks held on the prefill worker for good."""

from __future__ import annotations

import queue
import threading

import torch

from services.engine.kv_cache.paged_cache import PagedKVCache
from services.transfer.channel import ChannelBase
from services.transfer.sender import KVSender, SendJob, SendReport
from services.transfer.streams import CpuSync


class GatedChannel(ChannelBase):
    """Sends to rank 1 block until ``gate`` opens, then fail (the peer left)."""

    def __init__(self) -> None:
        super().__init__(0, 2, [1], CpuSync(), 30.0)
        self.gate = threading.Event()
        self.sending = threading.Event()

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self.sending.set()
        self.gate.wait(30)
        raise ConnectionError("peer left")

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        raise AssertionError("a sender does not receive")


def _sender(channel) -> tuple[KVSender, queue.Queue]:
    cache = PagedKVCache(2, 8, 16, 2, 16, torch.float32, torch.device("cpu"))
    reports: queue.Queue[SendReport] = queue.Queue()
    return KVSender(channel, cache.gather, cache.block_shape, cache.dtype, reports.put,
                    heartbeat_s=None), reports


def _job(tid: str) -> SendJob:
    return SendJob(tid, 1, [1, 2], range(0, 2), 0, True)


def test_a_send_that_outlasts_close_is_still_reported():
    channel = GatedChannel()
    sender, reports = _sender(channel)
    sender.submit(_job("slow"))
    assert channel.sending.wait(30)
    sender.close(wait_s=0.05)  # returns with the send still blocked
    channel.gate.set()
    report = reports.get(timeout=30)
    assert (report.transfer_id, report.ok) == ("slow", False)
    assert "peer left" in report.error
    sender.close()
    assert reports.empty()


class SlowPut:
    """A job queue whose first ``put`` lets ``close`` start (in another thread) before it
    puts: the interleaving where a job could land behind the stop sentinel."""

    def __init__(self, sender: KVSender) -> None:
        self._inner, self._sender = sender._jobs, sender
        self._closer: threading.Thread | None = None

    def put(self, item) -> None:
        if item is not None and self._closer is None:
            self._closer = threading.Thread(target=self._sender.close)
            self._closer.start()
            self._closer.join(timeout=0.3)  # close waits for this put, or has put its stop
        self._inner.put(item)

    def get(self, timeout=None):
        return self._inner.get(timeout=timeout)


def test_a_job_submitted_while_closing_is_reported():
    channel = GatedChannel()
    channel.gate.set()
    sender, reports = _sender(channel)
    slow = sender._jobs = SlowPut(sender)
    sender.submit(_job("racing"))
    slow._closer.join(timeout=30)
    report = reports.get(timeout=30)
    assert (report.transfer_id, report.ok) == ("racing", False)
    assert reports.empty()


def test_a_job_submitted_after_close_fails_at_once():
    sender, reports = _sender(GatedChannel())
    sender.close()
    sender.submit(_job("late"))
    report = reports.get_nowait()
    assert (report.transfer_id, report.ok, report.error) == ("late", False, "sender closed")
