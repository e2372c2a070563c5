"""The HTTP gateway (layer 6): OpenAI-compatible API, SSE, tokenization, health and metrics.

``create_app(backend, tokenizer, ...)`` builds the FastAPI app in front of a
:class:`Backend` (the cluster); ``serve(app, host, port)`` runs it with graceful draining.
"""

from __future__ import annotations

from tandem.gateway.app import create_app
from tandem.gateway.backend import Backend
from tandem.gateway.errors import APIError
from tandem.gateway.server import ServerThread, find_free_port, serve, serve_async

__all__ = ["APIError", "Backend", "ServerThread", "create_app", "find_free_port", "serve", "serve_async"]
