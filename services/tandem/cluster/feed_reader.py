"""The gateway's end of a decode worker's token feed: one Ray streaming call per worker
(and event loop) carrying the deltas of every request this gateway runs there, handed
to each request's queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

import ray

from tandem.decode.feed import FeedItem
from tandem.router.driver import WorkerLostError

log = logging.getLogger(__name__)


class FeedReader:
    """Reads ``actor.feed(subscriber)`` on the event loop it was made on and routes its
    items to the queues of that loop's requests.

    A request registers its queue before it starts on the worker; when the feed
    ends (the worker died or became unreachable) every registered queue gets the
    error that ``translate`` makes of the failure, and the reader is spent: the
    next request opens a new one.
    """

    def __init__(self, actor, worker_id: str,
                 translate: Callable[[BaseException], BaseException]) -> None:
        self.actor, self.worker_id = actor, worker_id
        self.subscriber = f"gateway-{uuid.uuid4().hex}"
        self.loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue[FeedItem | BaseException]] = {}
        self._translate = translate
        self._failure: BaseException | None = None
        self._gen = actor.feed.options(num_returns="streaming",
                                       enable_task_events=False).remote(self.subscriber)
        self._task = asyncio.ensure_future(self._read())

    @property
    def usable(self) -> bool:
        return self._failure is None and not self._task.done()

    def register(self, request_id: str) -> asyncio.Queue[FeedItem | BaseException]:
        queue: asyncio.Queue[FeedItem | BaseException] = asyncio.Queue()
        if self._failure is not None:
            queue.put_nowait(self._failure)
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        try:
            async for ref in self._gen:
                for item in await ref:
                    queue = self._queues.get(item.request_id)
                    if queue is not None:  # else the request has left already
                        queue.put_nowait(item)
            failure: BaseException = WorkerLostError(self.worker_id, "the token feed of "
                                                     f"{self.worker_id} ended", transient=True)
        except asyncio.CancelledError:
            failure = WorkerLostError(self.worker_id, f"the token feed of {self.worker_id} "
                                      "was closed", transient=True)
            raise
        except Exception as e:
            failure = e
        finally:
            self._failure = self._translate(failure)
            log.debug("token feed %s ended: %s", self.subscriber, failure)
            for queue in self._queues.values():
                queue.put_nowait(self._failure)

    def close(self) -> None:
        """Stop reading; the worker ends the requests still on the feed. Call on the
        reader's own event loop, or once that loop has closed."""
        if not self.loop.is_closed():
            self._task.cancel()
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.cancel(self._gen)
