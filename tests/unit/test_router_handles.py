"""Ray failures as the router sees them (services/tandem/cluster/handles.py): a transient
``ActorUnavailableError`` is retried, not death; a prefill queue timeout is a 503; a
decode worker's token feed carries every stream and its end fails each of them."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions as rex

from tandem.cluster.handles import RayDecode, RayWorker, is_transient
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.decode.feed import RequestFailedError, StreamError
from tandem.protocol.request_path import DecodeRequest, TokenDelta
from tandem.decode.worker import TransferFailedError
from tandem.engine.engine_loop import EngineLoopStopped
from tandem.gateway.errors import from_backend_error
from tandem.prefill.worker import PrefillTimeoutError
from tandem.router.driver import TransferError, WorkerLostError
from tandem.router.errors import PrefillQueueTimeoutError
from tandem.transfer.channel import ChannelBrokenError


def _task_error(cause: BaseException) -> rex.RayTaskError:
    return rex.RayTaskError("prefill", "Traceback ...", cause)


def test_unavailable_is_transient_and_death_is_not():
    w = RayWorker(None, "decode-0", "decode")
    unavailable = rex.ActorUnavailableError("connection reset", None)
    assert is_transient(unavailable)
    lost = w._translate(unavailable)
    assert isinstance(lost, WorkerLostError) and lost.transient and lost.worker_id == "decode-0"
    died = w._translate(rex.ActorDiedError())
    assert isinstance(died, WorkerLostError) and not died.transient
    assert not is_transient(rex.ActorDiedError())


def test_a_prefill_queue_timeout_is_a_503_and_a_failed_transfer_is_re_driven():
    w = RayWorker(None, "prefill-0", "prefill")
    timeout = w._translate(_task_error(PrefillTimeoutError("no first token within 120s")))
    assert isinstance(timeout, PrefillQueueTimeoutError)
    err = from_backend_error(timeout)
    assert err.status == 503 and "Retry-After" in err.headers
    assert isinstance(w._translate(_task_error(TransferFailedError("x"))), TransferError)
    broken = w._translate(_task_error(ChannelBrokenError("not in a transfer group")))
    assert isinstance(broken, TransferError)  # re-driven once the group is rebuilt
    stopped = w._translate(_task_error(EngineLoopStopped("the engine loop stopped")))
    assert isinstance(stopped, WorkerLostError) and not stopped.transient


class _FeedActor:
    """A decode actor whose ``feed`` yields the batches put into ``batches`` (a batch that
    is an exception ends the feed with it) and whose ``start`` returns at once."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue = asyncio.Queue()
        self.feed = _Method(self._feed)
        self.start = _Method(self._start)
        self.subscribers: list[str] = []

    async def _feed(self, subscriber: str):
        self.subscribers.append(subscriber)
        while True:
            batch = await self.batches.get()
            if isinstance(batch, BaseException):
                raise batch
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(batch)
            yield fut

    async def _start(self, req, subscriber: str):
        return None


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        result = self.fn(*args)
        return result if hasattr(result, "__aiter__") else asyncio.ensure_future(result)


def _req(rid: str) -> DecodeRequest:
    return DecodeRequest(rid, (1, 2, 3), SamplingParams(max_tokens=4), output_token_ids=(9,))


def test_one_feed_carries_every_stream_and_its_end_re_drives_all_of_them():
    async def main():
        actor = _FeedActor()
        w = RayDecode(actor, "decode-0", "decode")
        streams = [w.decode(_req(rid)) for rid in ("a", "b")]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0.01)
        assert len(actor.subscribers) == 1  # one feed for both requests
        actor.batches.put_nowait([TokenDelta("b", (5,), 1), TokenDelta("a", (6,), 1),
                                  TokenDelta("gone", (1,), 1)])  # a request that left: dropped
        assert [(await f).token_ids for f in firsts] == [(6,), (5,)]
        actor.batches.put_nowait(rex.ActorDiedError())
        for s in streams:
            with pytest.raises(WorkerLostError) as e:
                await s.__anext__()
            assert not e.value.transient and e.value.worker_id == "decode-0"
        # the next request opens a new feed
        late = w.decode(_req("c"))
        first = asyncio.ensure_future(late.__anext__())
        await asyncio.sleep(0.01)
        assert len(actor.subscribers) == 2
        actor.batches.put_nowait([TokenDelta("c", (7,), 1, True, FinishReason.STOP)])
        assert (await first).finished
        await late.aclose()
        assert w.active == {"a", "b"}  # ended without finishing: the driver aborts those
    asyncio.run(main())


@pytest.mark.parametrize("error, raised", [(EngineLoopStopped("stopped"), WorkerLostError),
                                           (RequestFailedError("a failed on decode-0"),
                                            RequestFailedError)])
def test_a_request_failure_on_the_feed_is_translated_like_a_call_error(error, raised):
    async def main():
        actor = _FeedActor()
        s = RayDecode(actor, "decode-0", "decode").decode(_req("a"))
        nxt = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)
        actor.batches.put_nowait([StreamError("a", error)])
        with pytest.raises(raised):
            await nxt
    asyncio.run(main())


def test_a_stream_with_no_progress_fails_after_the_stall_timeout(monkeypatch):
    import tandem.decode.feed as feed

    monkeypatch.setattr(feed, "STALL_TIMEOUT_S", 0.05)

    async def main():
        s = RayDecode(_FeedActor(), "decode-0", "decode").decode(_req("a"))
        with pytest.raises(RequestFailedError, match="no progress on decode-0"):
            await s.__anext__()
    asyncio.run(main())


def test_each_event_loop_reads_its_own_feed_and_a_closed_loops_feed_is_closed():
    actor = _FeedActor()
    w = RayDecode(actor, "decode-0", "decode")

    async def one(rid: str) -> tuple[int, ...]:
        actor.batches = asyncio.Queue()  # the fake's queue, on this loop
        s = w.decode(_req(rid))
        first = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)
        actor.batches.put_nowait([TokenDelta(rid, (3,), 1, True, FinishReason.STOP)])
        return (await first).token_ids

    assert asyncio.run(one("a")) == (3,)
    (first_loop,) = w._readers
    assert asyncio.run(one("b")) == (3,)
    assert first_loop not in w._readers and len(w._readers) == 1  # the closed loop's reader went
    assert len(actor.subscribers) == 2 and len(set(actor.subscribers)) == 2
