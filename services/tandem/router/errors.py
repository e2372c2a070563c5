"""Exceptions the router raises at its boundary."""

from __future__ import annotations


class RouterError(Exception):
    """Base of every router error."""


class ClusterFullError(RouterError):
    """No worker can take the request now; retry after ``retry_after_s`` seconds.

    Raised at once instead of queueing (the gateway answers 429/503 with
    ``Retry-After``).
    """

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoWorkersError(ClusterFullError):
    """No alive worker can serve the request at all (a pool is down or being replaced)."""


class PromptTooLargeError(RouterError, ValueError):
    """The prompt needs more KV blocks than any alive decode worker has in total."""


class PrefillQueueTimeoutError(NoWorkersError):
    """The prompt waited past the prefill deadline in a worker's queue (overloaded: 503)."""
