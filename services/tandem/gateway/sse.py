"""Server-sent events: ``data: {...}\\n\\n`` frames and the response that streams them.

Each frame's JSON escapes U+2028, U+2029 and U+0085 (NEL): JSON allows them raw in
strings, but many line splitters (Python's ``str.splitlines``, httpx's ``aiter_lines``,
JavaScript-era SSE clients) break lines there and would cut the event in two.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.gateway.errors import dumps

DONE = b"data: [DONE]\n\n"

# UTF-8 of the characters some clients take for line breaks -> their JSON escapes. UTF-8 is
# self-synchronising, so these byte runs only ever encode these characters.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def frame(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON, on one line whatever splitter a client uses."""
    data = dumps(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


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
