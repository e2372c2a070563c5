"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Strict: ``temperature: false``, ``max_tokens: "5"`` and ``n: 1.5`` are rejected (an
integer is still a valid float, and ``2.0`` a valid integer, as in JSON Schema). Unknown fields are ignored, as OpenAI-compatible
servers do, so newer clients keep working. The served OpenAPI schema says exactly what
is accepted: every numeric field has its range (``openapi.build_openapi`` fills in the
served model's and server's limits, marked here with ``x-limit``), fields that must stay
empty say so, and the tool-calling fields, unsupported, are left out of the schema but
refused when set (:data:`UNSUPPORTED_CHAT_FIELDS`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from tandem.common.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_PENALTY,
                                             MAX_REPETITION_PENALTY, MAX_SEED,
                                             MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                             MAX_TEMPERATURE, MAX_TOKEN_ID, MAX_TOKENS_LIMIT, MAX_TOP_K,
                                             MIN_REPETITION_PENALTY, MIN_TEMPERATURE)

_STRICT = ConfigDict(strict=True, extra="ignore")


def limit(name: str) -> dict[str, Any]:
    """Marks a schema node whose bound depends on the served model or the server (see openapi.py):
    ``vocab`` (maximum: the vocabulary size), ``token_id`` (maximum: vocabulary - 1),
    ``context`` (maximum / maxItems: the context length - 1), ``max_n``, ``max_prompts``,
    ``token_id_key`` (pattern: a token id of the vocabulary written as an object key)."""
    return {"x-limit": name}


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    return value


def _integral(value: Any) -> Any:
    """JSON Schema's integers include ``2.0``: an integral float becomes an int (``2.5``, NaN stay refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(ge: int, le: int, limit_name: str | None = None) -> Any:
    """An integer in [ge, le]: strict (no strings, no booleans), but ``2.0`` is the integer 2, as in
    JSON Schema (the bounds go before the validator, or pydantic leaves them out of the schema)."""
    extra = limit(limit_name) if limit_name else None
    return Annotated[int, Field(ge=ge, le=le, json_schema_extra=extra), BeforeValidator(_integral)]


def _false(value: bool) -> bool:
    if value:
        raise ValueError("not supported: must be false")
    return value


TokenId = _int(0, MAX_TOKEN_ID, "token_id")
MaxTokens = _int(1, MAX_TOKENS_LIMIT, "context")
MinTokens = _int(0, MAX_TOKENS_LIMIT)
TopK = _int(-1, MAX_TOP_K, "vocab")
# RFC 8259's interoperable integers: beyond 2**53 - 1, JSON tools compare as doubles, and a
# bound there would admit what the server refuses (SamplingParams itself takes up to 2**63 - 1).
MAX_JSON_SEED = min(MAX_SEED, 2**53 - 1)
Seed = _int(0, MAX_JSON_SEED)
NumChoices = _int(1, MAX_TOKENS_LIMIT, "max_n")
NumLogprobs = _int(0, MAX_LOGPROBS)
BestOf = _int(1, 1)
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKENS_LIMIT,
                                          json_schema_extra=limit("context"))]
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE), AfterValidator(_temperature), WithJsonSchema(
    {"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE}]})]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# Object keys naming token ids ("42"): decimal, no leading zeros; the served vocabulary bounds them.
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$", json_schema_extra=limit("token_id_key"))]
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                      Field(max_length=MAX_LOGIT_BIAS_TOKENS,
                            description="Token id (as a string) -> a bias in [-100, 100] added to its logit "
                            "before sampling: -100 bans the token, 100 all but forces it.")]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
NonEmptyText = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices."""

    model_config = _STRICT
    include_usage: bool | None = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: str = Field(description="The served model's id (see GET /v1/models).")
    max_tokens: MaxTokens | None = Field(None,
                                   description="Most tokens to generate; prompt + max_tokens must fit the context "
                                   "(else 400 context_length_exceeded).")
    temperature: Temperature | None = Field(None, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None,
                              description="-1 or 0 disables top-k.")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Seed | None = Field(None, description="Reproducible sampling; choice i uses seed + i.")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="Stop strings (not included in the output).")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: NumChoices | None = Field(None,
                          description="Choices to generate for each prompt.")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stream: bool | None = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: MinTokens | None = Field(None,
                                   description="EOS and stops are ignored until this many tokens were generated "
                                   "(capped at the request's max_tokens).")
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    user: str | None = Field(None, description="Accepted and ignored.")
    logit_bias: LogitBias | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: (NonEmptyText
             | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_TOKENS_LIMIT,
                                                   json_schema_extra=limit("max_prompts"))]
             | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_TOKENS_LIMIT,
                                               json_schema_extra=limit("max_prompts"))]) = Field(
        description="A string, a list of strings, a list of token ids, or a list of lists of token ids.")
    logprobs: NumLogprobs | None = Field(None,
                                 description="Return the logprobs of this many most likely tokens per position.")
    echo: Annotated[bool, AfterValidator(_false), WithJsonSchema({"const": False})] | None = Field(
        False, description="Not supported: must be false.")
    suffix: None = Field(None, description="Not supported: must be absent.")
    best_of: BestOf | None = Field(None, description="Not supported beyond 1.")


class TextPart(BaseModel):
    """One part of a message's content: only text parts are supported."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], Field(min_length=1)]


class _Message(BaseModel):
    model_config = _STRICT
    content: Content = Field(description="Text, or a non-empty list of text parts (joined with newlines).")
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    """A previous answer (tool calls are not supported, so its content is required)."""

    role: Literal["assistant"]


ChatMessage = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage,
                        Field(discriminator="role")]


class ResponseFormat(BaseModel):
    """Only plain text output is supported."""

    model_config = _STRICT
    type: Literal["text"]


# Tool calling is not supported: these fields are not in the schema, and setting one is refused.
UNSUPPORTED_CHAT_FIELDS = ("tools", "tool_choice", "functions", "function_call")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = Field(None,
                                              description="Preferred over max_tokens.")
    logprobs: bool | None = Field(False, description="Return the logprob of each output token.")
    top_logprobs: NumLogprobs | None = Field(None,
                                     description="With logprobs: this many most likely tokens per position.")
    response_format: ResponseFormat | None = None
    tools: SkipJsonSchema[Any] = None
    tool_choice: SkipJsonSchema[Any] = None
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
