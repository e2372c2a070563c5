"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Strict: ``temperature: false``, ``max_tokens: "5"`` and ``n: 1.5`` are rejected (an
integer is still a valid float). Unknown fields are ignored, as OpenAI-compatible
servers do, so newer clients keep working; fields the gateway knows but does not
support (``echo``, ``suffix``, ``logit_bias``, ``tools`` ...) are rejected when set.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.sampling_params import MAX_LOGPROBS

_STRICT = ConfigDict(strict=True, extra="ignore")
TokenId = Annotated[int, Field(ge=0)]
MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices."""

    model_config = _STRICT
    include_usage: bool | None = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: str = Field(description="The served model's id (see GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables top-k.")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63, description="Reproducible sampling; choice i uses seed + i.")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="Stop strings (not included in the output).")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    n: int | None = Field(None, ge=1, description="Choices to generate for each prompt.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stream: bool | None = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    user: str | None = Field(None, description="Accepted and ignored.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be empty.")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of lists of token ids.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Return the logprobs of this many most likely tokens per position.")
    echo: bool | None = Field(False, description="Not supported: must be false.")
    suffix: str | None = Field(None, description="Not supported: must be absent.")
    best_of: int | None = Field(None, ge=1, description="Not supported beyond 1.")


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message; extra keys (``name``, ``tool_calls`` ...) reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Preferred over max_tokens.")
    logprobs: bool | None = Field(False, description="Return the logprob of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="With logprobs: this many most likely tokens per position.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported: must be empty.")
    response_format: dict[str, Any] | None = Field(None, description="Only {\"type\": \"text\"}.")
