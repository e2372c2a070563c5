"""The gateway's FastAPI app: OpenAI-compatible endpoints plus health, readiness and metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from tandem.gateway.backend import Backend
from tandem.gateway.chat import create_chat_completion
from tandem.gateway.completions import create_completion
from tandem.gateway.errors import install_handlers, json_response
from tandem.gateway.metrics import default_registries, render
from tandem.gateway.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from tandem.gateway.openapi import (READ_RESPONSES, ChatCompletionResponse, CompletionResponse, ModelCard,
                                      ModelList, Status, build_openapi, generate_responses)
from tandem.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tandem.gateway.state import GatewayState
from tandem.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MiB = 1 << 20
OPEN_PATHS = ("/health", "/ready", "/metrics")  # reachable without an API key (unless metrics_require_key)


def create_app(backend: Backend, tokenizer: Tokenizer, *, api_keys: Sequence[str] = (),
               max_body_bytes: int = 4 * MiB, request_timeout_s: float | None = 600, max_n: int = 16,
               max_prompts: int = 64, ready_timeout_s: float = 5.0,
               metrics_require_key: bool = False) -> FastAPI:
    """The HTTP gateway in front of ``backend``.

    ``api_keys``: accepted bearer tokens (none: no authentication); /health, /ready and
    /metrics stay open (``metrics_require_key``: /metrics needs a key too). /ready and
    /metrics read what the backend caches; they do not call the workers.
    ``max_body_bytes``: larger bodies get 413. ``request_timeout_s``:
    deadline of one request (None: none), after which it is aborted and answered 504
    (or, once streaming, with an SSE error event). ``max_n``: the largest ``n``;
    ``max_prompts``: the most prompts in one completions request. ``ready_timeout_s``
    bounds ``backend.ready()`` inside ``GET /ready``.
    """
    for name, value in (("max_body_bytes", max_body_bytes), ("max_n", max_n), ("max_prompts", max_prompts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s!r}")
    if isinstance(api_keys, str):
        raise ValueError("api_keys must be a sequence of keys, not one string")
    if metrics_require_key and not api_keys:
        raise ValueError("metrics_require_key needs api_keys: /metrics cannot ask for a key none has")
    state = GatewayState(backend=backend, tokenizer=tokenizer, request_timeout_s=request_timeout_s, max_n=max_n,
                         max_prompts=max_prompts, ready_timeout_s=ready_timeout_s)
    app = FastAPI(title="tandem", version="0.1.0", docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API of a disaggregated prefill/decode LLM cluster.")
    app.state.gateway = state
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    open_paths = [p for p in OPEN_PATHS if not (metrics_require_key and p == "/metrics")]
    app.add_middleware(ApiKeyMiddleware, api_keys=list(api_keys), open_paths=open_paths)  # outermost: runs first

    @app.post("/v1/completions", response_model=None, responses=generate_responses(CompletionResponse),
              summary="Create a completion")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions", response_model=None, responses=generate_responses(ChatCompletionResponse),
              summary="Create a chat completion")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    @app.get("/v1/models", response_model=ModelList, responses=READ_RESPONSES, summary="List the served model")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [state.model_card()]})

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=READ_RESPONSES, summary="Describe a model")
    async def get_model(model: str) -> Response:
        state.check_model(model)
        return json_response(state.model_card())

    @app.get("/health", response_model=Status, summary="Liveness: 200 while the process serves")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready", response_model=Status, summary="Readiness: 200 when the worker pools are up",
             responses={503: {"model": Status, "description": "Not ready (or draining)"}})
    async def ready() -> Response:
        if state.draining:
            return json_response({"status": "draining"}, 503)
        try:
            ok = await asyncio.wait_for(backend.ready(), ready_timeout_s)
        except Exception as e:  # noqa: BLE001 - a failing probe means "not ready"
            log.warning("readiness probe failed: %r", e)
            ok = False
        return json_response({"status": "ready" if ok else "not ready"}, 200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        extra = []
        families = getattr(backend, "metric_families", None)  # the cluster's and its workers'
        if families is not None:
            try:
                extra = await asyncio.wait_for(families(), ready_timeout_s)
            except Exception as e:  # noqa: BLE001 - serve the gateway's own families anyway
                log.warning("cluster metrics unavailable: %r", e)
        return Response(render(default_registries(state.metrics_registry), extra),
                        media_type=CONTENT_TYPE_LATEST)

    app.openapi = partial(build_openapi, app, backend.model_id)  # type: ignore[method-assign]
    return app
