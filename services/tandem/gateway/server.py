"""Running the gateway: uvicorn with graceful draining, and helpers for tests and benchmarks."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from tandem.gateway.errors import APIError
from tandem.gateway.state import GatewayState, mark_draining

DEFAULT_DRAIN_TIMEOUT_S = 30.0
CUT_GRACE_S = 5.0  # after the drain timeout: for cut streams to send their error and [DONE]


class _CuttableBackend:
    """The app's backend, with every stream cut cleanly on demand: once ``cut`` is set,
    each ``generate`` raises a 503 ``APIError``, which the response turns into an SSE
    error event followed by ``[DONE]`` (or a 503 body), and the backend request is
    closed (aborted) behind it. Everything else is the wrapped backend's."""

    def __init__(self, inner: Any, cut: asyncio.Event) -> None:
        self._inner, self._cut = inner, cut

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, *args: Any, **kwargs: Any):
        stream = self._inner.generate(*args, **kwargs)
        cut = asyncio.ensure_future(self._cut.wait())
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({step, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise APIError(503, "the server is shutting down and could not finish "
                                   "this request in its drain time; retry it",
                                   code="server_shutting_down", headers={"Retry-After": "1"})
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                yield delta
        finally:
            cut.cancel()
            if step is not None and not step.done():  # the stream must be idle to be closed
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await stream.aclose()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests: bind soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` that drains on SIGINT/SIGTERM and returns instead of re-raising the signal.

    The first signal stops accepting connections, makes ``/ready`` answer 503, and waits
    up to the drain timeout for in-flight requests (streams included). What is still
    running then is cut cleanly: streams end with an SSE error event and ``[DONE]``,
    other requests get a 503, and their backend requests are aborted; only what does not
    end within a few more seconds is cancelled outright. A second signal forces the exit.
    ``serve()`` then returns normally so the caller can shut its cluster down.
    """

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self._cut: asyncio.Event | None = None
        state = getattr(getattr(config.app, "state", None), "gateway", None)
        self._state = state if isinstance(state, GatewayState) else None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if self._state is not None and self._cut is None:  # the event belongs to this loop
            self._cut = asyncio.Event()
            self._state.backend = _CuttableBackend(self._state.backend, self._cut)
        await super().serve(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._cut is not None:
            asyncio.get_running_loop().call_later(self.drain_timeout_s, self._cut.set)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        mark_draining(self.config.app)
        if self.should_exit:
            self.force_exit = True
        else:
            self.should_exit = True

    def request_exit(self) -> None:
        """What a SIGTERM does (thread-safe: sets flags the server polls)."""
        self.handle_exit(signal.SIGTERM, None)


def make_server(app: Any, host: str = "127.0.0.1", port: int = 8000, *,
                drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, log_level: str = "info",
                access_log: bool = True, **uvicorn_kwargs: Any) -> GatewayServer:
    """A configured, not yet started :class:`GatewayServer` (extra kwargs go to ``uvicorn.Config``)."""
    if drain_timeout_s < 0:
        raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
    config = uvicorn.Config(app, host=host, port=port,
                            timeout_graceful_shutdown=drain_timeout_s + CUT_GRACE_S,
                            log_level=log_level, access_log=access_log, lifespan="on", **uvicorn_kwargs)
    return GatewayServer(config, drain_timeout_s)


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, *,
          drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, log_level: str = "info",
          access_log: bool = True, **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then drain in-flight requests (up to
    ``drain_timeout_s``) and return. Blocks; runs its own event loop."""
    make_server(app, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level,
                access_log=access_log, **uvicorn_kwargs).run()


async def serve_async(app: Any, host: str = "127.0.0.1", port: int = 8000, *,
                      drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, log_level: str = "info",
                      access_log: bool = True, **uvicorn_kwargs: Any) -> None:
    """:func:`serve` on the running event loop (for callers whose backend lives on it)."""
    await make_server(app, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level,
                      access_log=access_log, **uvicorn_kwargs).serve()


class ServerThread:
    """The app on a real uvicorn server in a background thread (tests, benchmarks).

    ``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``; leaving the block
    drains like a SIGTERM would and joins the thread.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, *,
                 drain_timeout_s: float = 5.0, log_level: str = "warning", **uvicorn_kwargs: Any) -> None:
        self.host = host
        self.port = port if port is not None else find_free_port(host)
        self.server = make_server(app, host, self.port, drain_timeout_s=drain_timeout_s, log_level=log_level,
                                  access_log=False, **uvicorn_kwargs)
        self._thread = threading.Thread(target=self._run, name=f"gateway-{self.port}", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - surfaced by start()/stop()
            self.error = e

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        """Start and wait until the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the gateway server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway server did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain and stop (like SIGTERM); wait for the thread."""
        self.server.request_exit()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the gateway server did not stop within {timeout_s} s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
