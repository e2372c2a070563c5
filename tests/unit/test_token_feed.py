"""The decode worker's token feed: batching, ordering, stale streams, errors, and the
engine thread racing the reader."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from tandem.common.sampling_params import FinishReason
from tandem.decode.feed import RequestFailedError, StreamError, TokenFeed
from tandem.engine.engine import EngineOutput
from tandem.engine.engine_loop import EngineLoopStopped
from tandem.protocol.request_path import TokenDelta


def _out(rid: str, *tokens: int, reason: FinishReason | None = None) -> EngineOutput:
    return EngineOutput(rid, list(tokens), reason is not None, reason, 4, 0, 0)


def _feed(ended: list[str]) -> TokenFeed:
    return TokenFeed(asyncio.get_running_loop(), "d0", ended.append)


def test_outputs_of_one_wakeup_come_as_one_batch_with_one_delta_per_request():
    async def main():
        ended: list[str] = []
        feed = _feed(ended)
        on_a, _ = feed.add("a", 1)
        on_b, _ = feed.add("b", 3)
        on_a(_out("a", 10))
        on_b(_out("b", 20))
        on_a(_out("a", 11))
        batch = await feed.next_batch()
        assert batch == [TokenDelta("a", (10, 11), 1), TokenDelta("b", (20,), 3)]
        on_a(_out("a", 12, reason=FinishReason.LENGTH))
        batch = await feed.next_batch()
        assert batch == [TokenDelta("a", (12,), 3, True, FinishReason.LENGTH)]
        assert ended == ["a"] and feed.request_ids == ["b"]
    asyncio.run(main())


def test_a_stale_stream_of_the_same_id_is_not_delivered_to_its_successor():
    async def main():
        feed = _feed([])
        on_old, _ = feed.add("r", 1)
        on_old(_out("r", reason=FinishReason.ABORT))  # the abort of the earlier attempt, pending
        on_new, _ = feed.add("r", 1)  # re-driven to this worker before the batch was read
        on_new(_out("r", 7))
        assert await feed.next_batch() == [TokenDelta("r", (7,), 1)]
    asyncio.run(main())


def test_a_removed_request_gets_nothing_and_errors_are_named():
    async def main():
        ended: list[str] = []
        feed = _feed(ended)
        on_a, err_a = feed.add("a", 1)
        _, err_b = feed.add("b", 1)
        on_c, _ = feed.add("c", 1)
        on_a(_out("a", 1))
        err_a(ValueError("bad top_k"))  # the step failed after the output: only the error goes
        err_b(EngineLoopStopped("stopped"))
        feed.remove("c")
        on_c(_out("c", 1))
        batch = await feed.next_batch()
        assert [type(i) for i in batch] == [StreamError, StreamError]
        by_id = {i.request_id: i.error for i in batch}
        assert isinstance(by_id["a"], RequestFailedError) and "ValueError: bad top_k" in str(by_id["a"])
        assert "d0" in str(by_id["a"])
        assert isinstance(by_id["b"], EngineLoopStopped)
        assert sorted(ended) == ["a", "b"] and feed.request_ids == []
    asyncio.run(main())


@pytest.mark.parametrize("seed", range(3))
def test_an_engine_thread_racing_the_reader_loses_and_repeats_nothing(seed):
    """Outputs pushed from another thread at random moments while batches are read: every
    token of every request arrives once, in order, at the right index."""
    rng = random.Random(seed)
    n_requests, n_tokens = 12, 60

    async def main():
        feed = _feed([])
        sinks = {f"r{i}": feed.add(f"r{i}", 1)[0] for i in range(n_requests)}

        def engine():
            for step in range(n_tokens):
                for rid, sink in sinks.items():
                    last = step == n_tokens - 1
                    sink(_out(rid, step, reason=FinishReason.LENGTH if last else None))
                    if rng.random() < 0.1:
                        threading.Event().wait(rng.random() * 1e-3)
        thread = threading.Thread(target=engine)
        thread.start()
        got: dict[str, list[int]] = {rid: [] for rid in sinks}
        finished = set()
        while len(finished) < n_requests:
            for delta in await asyncio.wait_for(feed.next_batch(), 10):
                assert delta.index == 1 + len(got[delta.request_id])
                got[delta.request_id] += delta.token_ids
                if delta.finished:
                    finished.add(delta.request_id)
        thread.join()
        assert all(tokens == list(range(n_tokens)) for tokens in got.values())
    asyncio.run(main())
