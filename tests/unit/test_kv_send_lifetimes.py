"""A prompt's KV on a prefill worker is freed exactly once, however its transfer ends.

The sender, closed when its group is rebuilt, reports every transfer submitted exactly
once: when its send outlasts ``close``'s wait, when a job is submitted while ``close``
runs, and when its final group comes after ``close`` with an earlier group still sending
or already failed. The prefill worker fails a transfer once when its group is gone
mid-step, and a re-drive of a request to the same worker waits for the earlier attempt's
release. A transfer never reported, or a release that takes the wrong attempt's state,
keeps the prompt's blocks held for good."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.prefill.lifecycle import PrefillState
from tandem.transfer.channel import ChannelBase
from tandem.transfer.sender import KVSender, SendJob, SendReport
from tandem.transfer.device_sync import CpuSync


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


def _job(tid: str, group: int = 0, final: bool = True) -> SendJob:
    return SendJob(tid, 1, [1, 2], range(0, 2), group, final)


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


def test_a_final_group_after_close_with_an_earlier_group_still_sending_is_reported_once():
    channel = GatedChannel()
    sender, reports = _sender(channel)
    sender.submit(_job("t", 0, final=False))
    assert channel.sending.wait(30)
    sender.close(wait_s=0.05)
    sender.submit(_job("t", 1))
    channel.gate.set()  # group 0 fails now
    sender.close()
    assert [(r.transfer_id, r.ok, r.error) for r in _drain(reports)] == [("t", False, "sender closed")]


def test_a_final_group_after_close_of_a_transfer_that_failed_already_is_not_reported_again():
    channel = GatedChannel()
    channel.gate.set()
    sender, reports = _sender(channel)
    sender.submit(_job("t", 0, final=False))
    first = reports.get(timeout=30)
    sender.close()
    sender.submit(_job("t", 1))
    assert (first.transfer_id, first.ok) == ("t", False) and "peer left" in first.error
    assert _drain(reports) == []


def _drain(reports: queue.Queue) -> list[SendReport]:
    out = []
    while not reports.empty():
        out.append(reports.get_nowait())
    return out


def test_a_prefill_worker_that_left_its_group_fails_a_transfer_once(tiny_model_dir):
    """Its group is gone mid-step (a rebuild): the request's transfer fails at its first
    layer group and the rest of the step's layers leave it alone."""
    from types import SimpleNamespace

    from tandem.common.config import CacheConfig, EngineConfig
    from tandem.prefill.lifecycle import PrefillingRequest, PrefillState
    from tandem.prefill.worker import PrefillWorker
    from tandem.protocol.messages import KVTransferDescriptor

    worker = PrefillWorker("prefill-0", EngineConfig(model=str(tiny_model_dir),
                                                     cache=CacheConfig(num_blocks=8)))
    try:
        layers = worker.engine.model_config.num_layers
        worker.requests["r"] = PrefillingRequest("r", PrefillState.PREFILLING, KVTransferDescriptor(
            request_id="r", transfer_id="r#t", block_ids=(3,),
            layer_groups=tuple((i, i + 1) for i in range(layers)), src_rank=0, dst_rank=1,
            num_prompt_tokens=4))
        seq = SimpleNamespace(seq_id="r", block_ids=[5])
        for layer in range(layers):
            worker._on_layer_done(layer, [seq])
        assert layers > 1 and worker.transfer_failures == 1
    finally:
        worker.shutdown()


def _prefill_worker_with_gated_sends(tiny_model_dir):
    """A real PrefillWorker (tiny model, 16 blocks) whose sends go to a ``GatedChannel``."""
    from tandem.common.config import CacheConfig, EngineConfig
    from tandem.prefill.worker import PrefillWorker
    from tandem.transfer.endpoint import make_sender

    worker = PrefillWorker("prefill-0", EngineConfig(model=str(tiny_model_dir),
                                                     cache=CacheConfig(num_blocks=16)))
    channel = GatedChannel()
    worker.sender = make_sender(channel, worker.engine, worker._on_sent, None)
    worker._joined = True
    return worker, channel


async def _until_released(worker, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until the worker holds no request and no transfer descriptor."""
    import asyncio

    for _ in range(int(timeout_s / 0.01)):
        if not worker.engine.scheduler.seqs and not worker.requests:
            return
        await asyncio.sleep(0.01)


def _assert_nothing_held(worker) -> None:
    assert not worker.engine.scheduler.seqs, "a prefilled request is held for good"
    assert worker.engine.block_pool.num_free == worker.engine.block_pool.num_blocks


def test_a_redrive_to_the_same_prefill_worker_waits_for_the_earlier_attempts_release(
        tiny_model_dir):
    """Attempt 1's transfer fails while the engine is busy, so its release is queued; attempt
    2 of the same request comes before that release runs. Attempt 2 must not take the
    request's place until attempt 1 is released, or the release drops attempt 2's
    descriptor and its prompt KV is held for good."""
    import asyncio

    from tandem.common.sampling_params import SamplingParams
    from tandem.protocol.messages import KVTransferDescriptor
    from tandem.protocol.request_path import PrefillRequest

    worker, channel = _prefill_worker_with_gated_sends(tiny_model_dir)
    layers = worker.engine.model_config.num_layers
    prompt, params = tuple(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=4)

    def request(attempt: int) -> PrefillRequest:
        return PrefillRequest("r", prompt, params, KVTransferDescriptor(
            request_id="r", transfer_id=f"r#{attempt}", block_ids=(3, 4),
            layer_groups=((0, layers),), src_rank=0, dst_rank=1, num_prompt_tokens=len(prompt)))

    async def main():
        await worker.prefill(request(1))
        assert channel.sending.wait(30)  # attempt 1's KV is being sent
        hold = asyncio.Event()
        loop = asyncio.get_running_loop()
        held = threading.Event()
        worker.loop.submit(lambda e: (held.set(), asyncio.run_coroutine_threadsafe(
            hold.wait(), loop).result(30)))
        assert held.wait(30)  # the engine thread is busy
        channel.gate.set()  # attempt 1 fails: its release is queued behind the busy engine
        for _ in range(3000):
            if worker.transfer_failures:
                break
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(worker.prefill(request(2)))
        await asyncio.sleep(0.2)
        hold.set()
        await second  # its own send fails too (the peer is gone) and frees its blocks
        await _until_released(worker)

    try:
        asyncio.run(main())
        assert worker.transfer_failures == 2
        _assert_nothing_held(worker)
    finally:
        worker.shutdown()


def test_a_step_that_fails_after_its_sends_were_queued_leaves_nothing_held(tiny_model_dir):
    """The step computing a prompt queues its KV's send, then raises (in sampling). The
    request's abort finds its send queued and leaves it to the send's report; that
    report's release comes before the request runs again (the engine is held between), and
    must end the request although it never reached the held-for-export state: otherwise
    the next step finishes its prefill and holds its blocks with nobody to free them."""
    import asyncio

    from tandem.common.sampling_params import SamplingParams
    from tandem.prefill.worker import PrefillFailedError
    from tandem.protocol.messages import KVTransferDescriptor
    from tandem.protocol.request_path import PrefillRequest

    worker, channel = _prefill_worker_with_gated_sends(tiny_model_dir)
    layers = worker.engine.model_config.num_layers
    prompt = tuple(range(3, 23))
    runner, hold = worker.engine.runner, threading.Event()
    sample = runner._sample

    def failing_once(*args, **kwargs):
        runner._sample = sample
        worker.loop.submit(lambda e: hold.wait(30))  # the engine waits after this step
        raise RuntimeError("sampling failed")
    runner._sample = failing_once

    async def main():
        prefill = asyncio.ensure_future(worker.prefill(PrefillRequest(
            "r", prompt, SamplingParams(temperature=0.0), KVTransferDescriptor(
                request_id="r", transfer_id="r#0", block_ids=(3, 4),
                layer_groups=((0, layers),), src_rank=0, dst_rank=1,
                num_prompt_tokens=len(prompt)))))
        for _ in range(3000):
            if worker.loop.failed_steps:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the request's abort is queued behind the held engine
        assert worker.requests["r"].state is PrefillState.SENDING
        # its send fails (the peer left): the report's release is queued after the abort
        worker._on_sent(SendReport("r#0", False, "ConnectionError: peer left", 0, 0.0))
        hold.set()
        with pytest.raises(PrefillFailedError, match="sampling failed"):
            await prefill
        await asyncio.sleep(0.5)  # a step that would run it again has had its chance

    try:
        asyncio.run(main())
        assert worker.loop.failed_steps == 1 and worker.transfer_failures == 1
        _assert_nothing_held(worker)
    finally:
        channel.gate.set()  # the real send ends; its report finds the transfer gone
        worker.shutdown()


def test_an_abort_queued_behind_a_busy_engine_leaves_a_later_attempt_alone(tiny_model_dir):
    """The gateway aborts attempt 1 of a request (its prefill had failed) and re-drives it
    to the same worker at once. The abort runs on the engine thread, behind a step; attempt
    2 registers its descriptor meanwhile and queues its ``add_request`` behind the abort.
    The abort must not take attempt 2's descriptor: attempt 2 would be prefilled with no
    transfer to send and release its KV, held for good."""
    import asyncio

    from tandem.common.sampling_params import SamplingParams
    from tandem.protocol.messages import KVTransferDescriptor
    from tandem.protocol.request_path import PrefillRequest

    worker, channel = _prefill_worker_with_gated_sends(tiny_model_dir)
    channel.gate.set()  # every send fails at once (the peer left): each report releases
    layers = worker.engine.model_config.num_layers
    prompt = tuple(range(3, 23))
    hold = threading.Event()

    async def main():
        held = threading.Event()
        worker.loop.submit(lambda e: (held.set(), hold.wait(30)))
        assert held.wait(30)  # the engine thread is busy (a long step)
        abort = asyncio.ensure_future(worker.abort("r"))  # attempt 1's: nothing registered
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(worker.prefill(PrefillRequest(
            "r", prompt, SamplingParams(temperature=0.0, max_tokens=4), KVTransferDescriptor(
                request_id="r", transfer_id="r#2", block_ids=(3, 4),
                layer_groups=((0, layers),), src_rank=0, dst_rank=1,
                num_prompt_tokens=len(prompt)))))
        await asyncio.sleep(0.1)
        assert "r" in worker.requests  # attempt 2 registered, its add_request queued
        hold.set()
        await abort
        await second  # prefilled; its send fails and its report frees the KV
        await _until_released(worker)

    try:
        asyncio.run(main())
        assert worker.transfer_failures == 1  # attempt 2's transfer was tried
        _assert_nothing_held(worker)
    finally:
        hold.set()
        worker.shutdown()


def test_a_step_that_fails_between_layer_groups_frees_its_blocks_after_the_queued_sends(
        tiny_model_dir):
    """Group 0 of the prompt's KV is queued (and being sent) when the step raises at a
    later layer. The blocks it reads stay held until that send ends: freed at once, a
    later request could write them while the send reads. The transfer is reported failed
    once, and nothing is held after."""
    import asyncio

    from tandem.common.sampling_params import SamplingParams
    from tandem.prefill.worker import PrefillFailedError
    from tandem.protocol.messages import KVTransferDescriptor
    from tandem.protocol.request_path import PrefillRequest

    worker, channel = _prefill_worker_with_gated_sends(tiny_model_dir)
    layers = worker.engine.model_config.num_layers
    assert layers >= 2
    on_layer_done = worker.loop._on_layer_done

    def failing_after_group_0(layer, completing):
        on_layer_done(layer, completing)
        if layer == 0 and completing:
            worker.loop._on_layer_done = on_layer_done
            raise RuntimeError("layer 1 failed")
    worker.loop._on_layer_done = failing_after_group_0
    pool = worker.engine.block_pool

    async def main():
        with pytest.raises(PrefillFailedError, match="layer 1 failed"):
            await worker.prefill(PrefillRequest(
                "r", tuple(range(3, 23)), SamplingParams(temperature=0.0), KVTransferDescriptor(
                    request_id="r", transfer_id="r#0", block_ids=(3, 4),
                    layer_groups=((0, 1), (1, layers)), src_rank=0, dst_rank=1,
                    num_prompt_tokens=20)))
        assert channel.sending.wait(30)  # group 0 is being sent (on the sender's thread)
        await asyncio.sleep(0.3)  # a step that would run it again has had its chance
        assert pool.num_free < pool.num_blocks, "freed while a send reads them"
        assert worker.transfer_failures == 0 and worker.requests["r"].state is PrefillState.SENDING
        channel.gate.set()  # group 0's send ends (failed); the abandonment follows it
        await _until_released(worker)

    try:
        asyncio.run(main())
        assert worker.loop.failed_steps == 1 and worker.transfer_failures == 1
        _assert_nothing_held(worker)
    finally:
        channel.gate.set()
        worker.shutdown()


def test_an_abandoned_transfer_is_reported_after_its_queued_groups():
    channel = GatedChannel()
    sender, reports = _sender(channel)
    sender.submit(_job("t", 0, final=False))
    assert channel.sending.wait(30)
    sender.abandon("t", 1, "step failed")
    assert reports.empty()  # group 0 is still sending
    channel.gate.set()
    report = reports.get(timeout=30)
    assert (report.transfer_id, report.ok) == ("t", False)
    sender.close()
    assert _drain(reports) == []


def test_an_abandoned_transfer_of_a_healthy_peer_reports_the_abandonment():
    channel = GatedChannel()
    channel.send = lambda data, dst_rank: None  # group 0 goes out fine
    sender, reports = _sender(channel)
    sender.submit(_job("t", 0, final=False))
    sender.abandon("t", 1, "step failed")
    report = reports.get(timeout=30)
    assert (report.transfer_id, report.ok) == ("t", False)
    assert report.error == "TransferAbandoned: step failed"
    sender.close()
    assert _drain(reports) == []
