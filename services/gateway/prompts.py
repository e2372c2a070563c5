"""Prompts to token ids: completion prompts in their four shapes, chat messages via the template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.gateway.errors import bad_request
from services.gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from services.text.tokenizer import Tokenizer


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 unless every id is in ``[0, vocab_size)``."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"{param} contains token id {t}, outside the vocabulary [0, {vocab_size})",
                              param=param, code="invalid_token_id")


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer, vocab_size: int,
                       max_prompts: int) -> list[list[int]]:
    """Token ids of each prompt (a string, strings, token ids, or lists of token ids)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request, got {len(items)}", param="prompt")
    out = []
    for item in items:
        ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        if not ids or (isinstance(item, str) and not item):
            raise bad_request("prompt must not be empty", param="prompt")
        check_token_ids(ids, vocab_size, "prompt")
        out.append(ids)
    return out


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"unsupported content part type {part.type!r}: only text parts are supported",
                                  param="messages")
            texts.append(part.text)
        d["content"] = "\n".join(texts)
    return d


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids of the rendered chat template (its text already holds BOS and the like)."""
    messages = [_message_dict(m) for m in req.messages]
    try:  # special-token text inside a message stays plain text
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from e
    if not ids:
        raise bad_request("the chat template rendered an empty prompt", param="messages")
    check_token_ids(ids, vocab_size, "messages")
    return ids
