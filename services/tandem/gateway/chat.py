"""``POST /v1/chat/completions``: messages through the chat template, ``chat.completion`` out."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tandem.gateway.errors import bad_request
from tandem.gateway.generation import ChoiceEvent, ChoiceJob, ChoiceResult, Generation
from tandem.gateway.logprobs import TokenStrings, chat_logprobs
from tandem.gateway.prompts import chat_prompt
from tandem.gateway.responder import respond
from tandem.gateway.sampling import check_common, max_tokens_for, sampling_params
from tandem.gateway.schemas import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from tandem.gateway.state import GatewayState


class ChatFormat:
    """Renders ``chat.completion`` responses and ``chat.completion.chunk`` s."""

    def __init__(self, base: dict[str, Any], strings: TokenStrings, num_logprobs: int | None,
                 num_choices: int, include_usage: bool) -> None:
        self._base = base
        self._chunk_base = {**base, "object": "chat.completion.chunk"}
        self._strings = strings
        self._num_logprobs = num_logprobs
        self._num_choices = num_choices
        self._include_usage = include_usage

    def _logprobs(self, lps: Any) -> dict[str, Any] | None:
        if self._num_logprobs is None or lps is None:
            return None
        return {"content": chat_logprobs(self._strings, lps, self._num_logprobs)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {**self._chunk_base, "choices": [choice]}
        if self._include_usage:
            out["usage"] = None
        return out

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self._num_choices)]

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        if not ev.text and ev.finish_reason is None and not ev.logprobs:
            return None
        delta = {"content": ev.text} if ev.text else {}
        return self._chunk({"index": ev.index, "delta": delta, "logprobs": self._logprobs(ev.logprobs),
                            "finish_reason": ev.finish_reason})

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk_base, "choices": [], "usage": usage}

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": r.index, "message": {"role": "assistant", "content": r.text},
                    "logprobs": self._logprobs(r.logprobs), "finish_reason": r.finish_reason} for r in results]
        return {**self._base, "choices": choices, "usage": usage}


def _num_logprobs(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        if req.top_logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        return None
    return req.top_logprobs or 0


async def create_chat_completion(state: GatewayState, req: ChatCompletionRequest, request: Request) -> Response:
    """Validate, render the chat template, generate ``n`` choices and answer."""
    state.check_model(req.model)
    backend = state.backend
    for name in UNSUPPORTED_CHAT_FIELDS:
        value = getattr(req, name)
        if value not in (None, [], {}, "none"):
            raise bad_request(f"{name} is not supported (this server does not call tools)", param=name)
    n = check_common(req, max_n=state.max_n, vocab_size=backend.vocab_size,
                     max_model_len=backend.max_model_len)
    num_logprobs = _num_logprobs(req)
    ids = await chat_prompt(req, state.tokenizer, backend.vocab_size, backend.max_model_len)
    requested, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens
                        is not None else (req.max_tokens, "max_tokens"))
    max_tokens = max_tokens_for(requested, len(ids), backend.max_model_len, default=None, param=param,
                                prompt_param="messages")
    jobs = [ChoiceJob(i, ids, sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs, choice=i))
            for i in range(n)]
    rid = state.new_id("chatcmpl")
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    base = {"id": rid, "object": "chat.completion", "created": state.created_now(), "model": backend.model_id}
    fmt = ChatFormat(base, state.strings, num_logprobs, n, include_usage)
    gen = Generation(backend, state.tokenizer, rid, jobs, timeout_s=state.request_timeout_s, receive=request.receive,
                     metrics=state.metrics)
    return await respond(gen, fmt, stream=bool(req.stream), include_usage=include_usage, prompt_tokens=len(ids))
