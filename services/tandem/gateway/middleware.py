"""ASGI middleware: optional API keys, and the request body size limit.

Both are plain ASGI (not ``BaseHTTPMiddleware``) so streaming and cancellation pass
through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.gateway.errors import APIError


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) in ``scope``, or None."""
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


class ApiKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` matches a configured key.

    Keys are compared in constant time (``hmac.compare_digest``) against every key, with no
    early exit. ``open_paths`` (health, readiness, metrics) need no key. No keys: all open.
    """

    def __init__(self, app: ASGIApp, *, api_keys: Iterable[str] = (), open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self._keys = [k.encode() for k in api_keys if k]
        self._open = frozenset(open_paths)

    def _authorized(self, scope: Scope) -> bool:
        value = header(scope, b"authorization") or b""
        scheme, _, token = value.partition(b" ")
        token = token.strip()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(token, key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._keys and scope["path"] not in self._open and not self._authorized(scope):
            err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_body_bytes``, by ``Content-Length`` and by what actually arrives.

    The body is read (up to the limit) before the app runs, then replayed; later
    ``receive`` calls pass through, so the app still sees ``http.disconnect``.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
                if declared < 0:
                    raise ValueError
            except ValueError:
                await APIError(400, "invalid Content-Length header").response()(scope, receive, send)
                return
            if declared > self.max_body_bytes:
                await self._too_large().response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large().response()(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

