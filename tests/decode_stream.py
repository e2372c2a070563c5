"""A decode worker's deltas for one request, read as the gateway reads them: the request
started with ``DecodeWorker.start`` on a feed of its own, then that feed's batches.

Closing the stream early (or cancelling a wait on it) closes the feed, as a gateway
that goes away does: the worker ends the request (its one release path).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

from tandem.decode.feed import StreamError
from tandem.protocol.request_path import DecodeRequest, TokenDelta


async def decode_stream(worker, req: DecodeRequest) -> AsyncIterator[TokenDelta]:
    subscriber = f"test-{req.request_id}-{secrets.token_hex(4)}"
    feed = worker.feed(subscriber)
    batch = asyncio.ensure_future(feed.__anext__())  # the feed is open before the start
    try:
        last = await worker.start(req, subscriber)
        if last is not None:
            yield last
            return
        while True:
            for item in await batch:
                if isinstance(item, StreamError):
                    raise item.error
                yield item
                if item.finished:
                    return
            batch = asyncio.ensure_future(feed.__anext__())
    finally:
        batch.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await batch
        await feed.aclose()
