"""The interface the gateway needs from the cluster behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from tandem.common.sampling_params import SamplingParams
from tandem.protocol.request_path import TokenDelta

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """What serves generation requests behind the gateway (the cluster, or a fake in tests).

    ``generate`` streams one request's :class:`TokenDelta` s. Closing the iterator early
    (``aclose``, or cancelling the task that iterates it) aborts the request everywhere;
    the gateway always consumes it with ``contextlib.aclosing``. It may raise
    ``tandem.router.errors.ClusterFullError`` (``retry_after_s``), ``NoWorkersError``,
    ``PromptTooLargeError``, or ``ValueError`` for a request the workers refuse.

    The workers neither detokenize nor check stop strings: the gateway does both. EOS
    and stop token ids are handled by the workers (the finishing delta carries the stop
    token, with ``finish_reason`` ``stop``).
    """

    model_id: str  # the served model's name (what /v1/models lists and requests must name)
    max_model_len: int  # prompt + output limit
    vocab_size: int

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of one request (one sequence: ``params.n`` is 1)."""
        ...

    async def ready(self) -> bool:
        """Whether the pools are up and connected."""
        ...
