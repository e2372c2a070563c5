"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tandem.common.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tandem.router.driver import TransferError, WorkerLostError
from tandem.router.errors import ClusterFullError, NoWorkersError, PromptTooLargeError

log = logging.getLogger(__name__)

# error "type" per status (OpenAI's vocabulary where it has one)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable_error", 504: "timeout_error"}


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON (no NaN: callers clamp floats first)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def json_response(body: Any, status_code: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """A JSON response rendered with :func:`dumps`."""
    return Response(dumps(body), status_code=status_code, headers=dict(headers or {}),
                    media_type="application/json")


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """This error as a JSON response."""
        return json_response(self.body(), self.status, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "1"
    return str(max(1, math.ceil(seconds)))


# What a client reads when the cluster fails its request: fixed texts, never the
# exception's own (a worker's exception carries a remote traceback, pids, node IPs, actor
# ids and source paths). The detail goes to the gateway's log. The README lists them.
BACKEND_ERRORS: dict[str, tuple[int, str]] = {
    "no_workers": (503, "no workers are available to serve this request; retry after Retry-After seconds"),
    "cluster_full": (429, "the cluster is full; retry after Retry-After seconds"),
    "prompt_too_large": (400, "the prompt needs more KV cache than any worker of this cluster has"),
    "rejected_by_worker": (400, "the model workers refused this request's parameters"),
    "worker_failed": (503, "a worker failed while serving this request; retry it"),
    "internal_error": (500, "internal error; the server's log has the details"),
}


def backend_error(code: str, *, param: str | None = None, headers: Mapping[str, str] | None = None) -> APIError:
    """The fixed client error ``code`` of :data:`BACKEND_ERRORS`."""
    status, message = BACKEND_ERRORS[code]
    return APIError(status, message, param=param, code=code, headers=headers)


def from_backend_error(exc: BaseException) -> APIError:
    """Map what ``Backend.generate`` raises to the client's error (a fixed message; the detail is logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ClusterFullError):  # NoWorkersError included
        code = "no_workers" if isinstance(exc, NoWorkersError) else "cluster_full"
        log.warning("request refused (%s): %s", code, exc)
        return backend_error(code, headers={"Retry-After": retry_after(exc.retry_after_s)})
    if isinstance(exc, PromptTooLargeError):
        log.warning("request refused (prompt_too_large): %s", exc)
        return backend_error("prompt_too_large", param="prompt")
    if isinstance(exc, ValueError):
        log.warning("the workers refused a request", exc_info=exc)
        return backend_error("rejected_by_worker")
    if isinstance(exc, (WorkerLostError, TransferError)):
        log.error("a request failed after its retries", exc_info=exc)
        return backend_error("worker_failed", headers={"Retry-After": "1"})
    log.error("backend request failed", exc_info=exc)
    return backend_error("internal_error")


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """The request field an error location points at (``("body", "temperature")`` -> ``temperature``)."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    return parts[0] if parts and isinstance(parts[0], str) else None


# Fields that take one of several shapes: one sentence instead of an error per shape.
_SHAPES = {
    "prompt": "prompt must be a non-empty string, a non-empty list of non-empty strings, a non-empty list of "
              "token ids, or a non-empty list of non-empty lists of token ids (within the limits in /openapi.json)",
    "stop": f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to "
            f"{MAX_STOP_STRING_CHARS} characters",
}


_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's names of plain union branches


def _where(loc: tuple[Any, ...]) -> str:
    """``("body", "prompt", "list[constrained-str]", 0)`` -> ``prompt.0`` (pydantic's union branch
    names, which hold ``[`` or ``-`` or name a plain type, are left out: no field is named so)."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and ("[" in p or "-" in p or p in _TAGS))]
    return ".".join(parts) or "body"


def validation_error(exc: RequestValidationError) -> APIError:
    """A FastAPI/pydantic request validation error as a 400."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return bad_request("the request body is not valid JSON" + (f": {detail}" if detail else ""))
    if loc in (("body",), ()):
        return bad_request("the request body must be a JSON object (Content-Type: application/json)")
    param = _param_of(loc)
    if param in _SHAPES and all(_param_of(tuple(e.get("loc", ()))) == param for e in errors):
        return bad_request("invalid request: " + _SHAPES[param], param=param)
    msgs: list[str] = []
    for e in errors:
        msg = f"{_where(tuple(e.get('loc', ())))}: {str(e.get('msg', 'invalid value')).removeprefix('Value error, ')}"
        if msg not in msgs:
            msgs.append(msg)
    more = f" (and {len(msgs) - 3} more)" if len(msgs) > 3 else ""
    return bad_request("invalid request: " + "; ".join(msgs[:3]) + more, param=param)


def install_handlers(app: FastAPI) -> None:
    """Make every error the app returns (validation, 404/405, unexpected) OpenAI-shaped."""

    def counted(request: Request, err: APIError) -> Response:
        state = getattr(request.app.state, "gateway", None)
        if state is not None and request.url.path.startswith("/v1/"):
            state.metrics.requests.labels(finish_reason="error", status=str(err.status)).inc()
        return err.response()

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return counted(request, exc)

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return counted(request, validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            msg = f"unknown route: {request.method} {request.url.path}"
            code = "not_found"
        elif status == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            msg, code = str(exc.detail), None
        return counted(request, APIError(status, msg, code=code, headers=exc.headers))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return counted(request, backend_error("internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
