"""Response schemas for the OpenAPI document (the endpoints build plain dicts of these shapes)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

FinishReasonName = Literal["stop", "length"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None


class CompletionResponse(BaseModel):
    """A ``text_completion`` (also the shape of each streamed chunk, whose ``usage`` may be null)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None


class ChatCompletionResponse(BaseModel):
    """A ``chat.completion``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Status(BaseModel):
    status: str


_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying (integer >= 1).",
                                "schema": {"type": "integer", "minimum": 1}}}
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "A chunk's JSON, an error's JSON, or [DONE]"}},
    "description": "With stream: true, server-sent events (one schema per event): `data: <chunk JSON>` frames "
    "(an error after the stream started is a `data: {\"error\": ...}` frame), ending with `data: [DONE]`."}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {400: "Invalid request", 401: "Missing or invalid API key", 404: "Unknown model or route",
                    405: "Method not allowed", 413: "Request body too large",
                    429: "Cluster full: retry after Retry-After seconds",
                    500: "Internal error", 503: "No workers available or not ready",
                    504: "The request deadline passed"}
    out: dict[int | str, dict[str, Any]] = {}
    for s in statuses:
        out[s] = {"model": ErrorResponse, "description": descriptions[s]}
        if s in (429, 503):
            out[s]["headers"] = _RETRY_AFTER
    return out


def generate_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation route: JSON ``model`` or SSE, and every error."""
    ok = {"model": model, "content": _SSE, "description": "The response (JSON), or its chunks (SSE) when streaming"}
    return {200: ok, **_errors(400, 401, 404, 405, 413, 429, 500, 503, 504)}


READ_RESPONSES = _errors(401, 404, 405, 413)


def _apply_limits(node: Any, limits: dict[str, int]) -> None:
    """Replace each ``x-limit`` marker (see ``schemas.limit``) with the bound it names."""
    if isinstance(node, list):
        for item in node:
            _apply_limits(item, limits)
        return
    if not isinstance(node, dict):
        return
    name = node.pop("x-limit", None)
    if name == "token_id_key":
        node["pattern"] = integer_below_pattern(limits["vocab"])
    elif name is not None:
        key = "maxItems" if node.get("type") == "array" else "maximum"
        node[key] = min(node.get(key, limits[name]), limits[name])
    for value in node.values():
        _apply_limits(value, limits)


def integer_below_pattern(n: int) -> str:
    """A regex matching exactly the decimal integers in [0, n) (no sign, no leading zeros)."""
    if n < 1:
        raise ValueError(f"no integer is below {n}")
    top = str(n - 1)
    alts = ["0"] if n > 1 else []
    if len(top) > 1:  # every shorter number
        alts.append("[1-9]" + (f"[0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else ""))
    for i, digit in enumerate(top):  # as long as the top: below it from digit i on
        low = 1 if i == 0 else 0
        if int(digit) > low:
            hi = int(digit) - 1
            alts.append(top[:i] + (f"[{low}-{hi}]" if hi > low else str(low)) +
                        (f"[0-9]{{{len(top) - i - 1}}}" if i < len(top) - 1 else ""))
    alts.append(top)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


# top_logprobs > 0 needs logprobs: true (JSON Schema's if/then, so clients and fuzzers know)
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


def build_openapi(app: FastAPI, model_id: str) -> dict[str, Any]:
    """The app's OpenAPI document: no 422 (validation errors are 400), ``model`` an enum of the
    served one, and the bounds that depend on the model and the server filled in."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        prop = comps.get(name, {}).get("properties", {}).get("model")
        if prop is not None:
            prop["enum"] = [model_id]
    if "ChatCompletionRequest" in comps:
        comps["ChatCompletionRequest"].update(_TOP_LOGPROBS_NEED_LOGPROBS)
    state = app.state.gateway
    backend = state.backend
    _apply_limits(schema, {"vocab": backend.vocab_size, "token_id": backend.vocab_size - 1,
                           "context": backend.max_model_len - 1, "max_n": state.max_n,
                           "max_prompts": state.max_prompts})
    app.openapi_schema = schema
    return schema
