"""``POST /v1/completions``: prompts in, ``text_completion`` objects (or chunks) out."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tandem.gateway.errors import bad_request
from tandem.gateway.generation import ChoiceEvent, ChoiceJob, ChoiceResult, Generation
from tandem.gateway.logprobs import TokenStrings, completion_logprobs
from tandem.gateway.prompts import completion_prompts
from tandem.gateway.responder import respond
from tandem.gateway.sampling import check_common, max_tokens_for, sampling_params
from tandem.gateway.schemas import CompletionRequest
from tandem.gateway.state import GatewayState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionFormat:
    """Renders ``text_completion`` responses and chunks (one text offset per choice)."""

    def __init__(self, base: dict[str, Any], strings: TokenStrings, num_logprobs: int | None,
                 num_choices: int, include_usage: bool) -> None:
        self._base = base
        self._strings = strings
        self._num_logprobs = num_logprobs
        self._offsets = [0] * num_choices
        self._include_usage = include_usage

    def _logprobs(self, index: int, lps: Any) -> dict[str, Any] | None:
        if self._num_logprobs is None or lps is None:
            return None
        out, self._offsets[index] = completion_logprobs(self._strings, lps, self._num_logprobs, self._offsets[index])
        return out

    def opening(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, ev: ChoiceEvent) -> dict[str, Any] | None:
        if not ev.text and ev.finish_reason is None and not ev.logprobs:
            return None
        choice = {"index": ev.index, "text": ev.text, "logprobs": self._logprobs(ev.index, ev.logprobs),
                  "finish_reason": ev.finish_reason}
        out = {**self._base, "choices": [choice]}
        if self._include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._base, "choices": [], "usage": usage}

    def response(self, results: list[ChoiceResult], usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": r.index, "text": r.text, "logprobs": self._logprobs(r.index, r.logprobs),
                    "finish_reason": r.finish_reason} for r in results]
        return {**self._base, "choices": choices, "usage": usage}


async def create_completion(state: GatewayState, req: CompletionRequest, request: Request) -> Response:
    """Validate, tokenize, generate (``n`` choices per prompt, indexed prompt-major) and answer."""
    state.check_model(req.model)
    backend = state.backend
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of > 1:
        raise bad_request("best_of is not supported (use n)", param="best_of")
    n = check_common(req, max_n=state.max_n, vocab_size=backend.vocab_size,
                     max_model_len=backend.max_model_len)
    prompts = await completion_prompts(req, state.tokenizer, backend.vocab_size, state.max_prompts,
                                       backend.max_model_len)
    jobs = []
    for p, ids in enumerate(prompts):
        max_tokens = max_tokens_for(req.max_tokens, len(ids), backend.max_model_len, default=DEFAULT_MAX_TOKENS)
        for i in range(n):
            params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, choice=i)
            jobs.append(ChoiceJob(p * n + i, ids, params))
    rid = state.new_id("cmpl")
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    base = {"id": rid, "object": "text_completion", "created": state.created_now(), "model": backend.model_id}
    fmt = CompletionFormat(base, state.strings, req.logprobs, len(jobs), include_usage)
    gen = Generation(backend, state.tokenizer, rid, jobs, timeout_s=state.request_timeout_s, receive=request.receive,
                     metrics=state.metrics)
    return await respond(gen, fmt, stream=bool(req.stream), include_usage=include_usage,
                         prompt_tokens=sum(len(ids) for ids in prompts))
