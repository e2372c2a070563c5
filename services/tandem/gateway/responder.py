"""The path both endpoints share: start the generation, then stream SSE or answer once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.responses import Response

from tandem.gateway.errors import APIError, json_response
from tandem.gateway.generation import ChoiceEvent, ChoiceResult, ClientDisconnected, Generation
from tandem.gateway.metrics import CLIENT_CLOSED, count_error
from tandem.gateway.sse import DONE, EventStream, frame



class Formatter(Protocol):
    """Renders one endpoint's OpenAI objects."""

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before any output (chat: the assistant role)."""
        ...

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        """The stream chunk for ``ev`` (None: nothing worth sending)."""
        ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        ...

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streaming) response."""
        ...


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def respond(gen: Generation, fmt: Formatter, *, stream: bool, include_usage: bool,
                  prompt_tokens: int) -> Response:
    """Run ``gen`` and answer with SSE or JSON.

    Errors before the first byte (admission, validation by the workers, the deadline)
    are raised as :class:`APIError` and become proper HTTP statuses; errors after the
    stream started go out as an SSE error event followed by ``[DONE]``.
    """
    try:
        await gen.start()
    except ClientDisconnected:
        await gen.close()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await gen.close()
        raise
    if stream:
        return EventStream(_frames(gen, fmt, include_usage, prompt_tokens), on_close=gen.close)
    try:
        results = await gen.collect()
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        await gen.close()
    return json_response(fmt.response(results, usage(prompt_tokens, gen.completion_tokens)))


async def _frames(gen: Generation, fmt: Formatter, include_usage: bool, prompt_tokens: int) -> AsyncIterator[bytes]:
    error: APIError | None = None
    try:
        for c in fmt.opening():
            yield frame(c)
        async for ev in gen.events():
            c = fmt.chunk(ev)
            if c is not None:
                yield frame(c)
    except ClientDisconnected:
        return
    except APIError as e:
        error = e
        count_error(gen.metrics, e.status)
    await gen.close()  # every backend request is closed before the client hears [DONE]
    if error is not None:
        yield frame(error.body())
    elif include_usage:
        yield frame(fmt.usage_chunk(usage(prompt_tokens, gen.completion_tokens)))
    yield DONE
