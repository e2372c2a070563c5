"""Server-sent events: ``data: {...}\\n\\n`` frames and the response that streams them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import dumps

DONE = b"data: [DONE]\n\n"


def frame(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response over an async iterator of frames.

    Unlike Starlette's, it does not listen for the disconnect itself (the generation
    does, through ``receive``); a send that fails because the client left ends the
    stream quietly. ``on_close`` runs last, whatever happened, shielded from
    cancellation, so the backend requests behind the stream are always closed.
    """

    def __init__(self, frames: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]] | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._frames = frames
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self._frames:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away (servers on ASGI spec 2.4 raise on send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._frames, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._on_close is not None:
                    await self._on_close()
