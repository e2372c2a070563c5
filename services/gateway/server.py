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

from services.gateway.state import mark_draining

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests: bind soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` that drains on SIGINT/SIGTERM and returns instead of re-raising the signal.

    The first signal stops accepting connections, makes ``/ready`` answer 503, and waits
    up to the drain timeout for in-flight requests (streams included) before cancelling
    them (which aborts their backend requests). A second signal forces the exit.
    ``serve()`` then returns normally so the caller can shut its cluster down.
    """

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
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_timeout_s,
                            log_level=log_level, access_log=access_log, lifespan="on", **uvicorn_kwargs)
    return GatewayServer(config)


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
