"""Prompts to token ids: completion prompts in their four shapes, chat messages via the template.

Tokenizing is slow (seconds for a few MB of text) and must not freeze the event loop that
streams every other response, so it runs in a worker thread, through ``encode_batch``,
which releases the GIL (the tokenizer's ``encode`` holds it all along). Before any of that
work, a size bound refuses text that cannot fit the context whatever its tokens:
no token covers more than the vocabulary's longest entry, so a text of ``B`` UTF-8 bytes
has at least ``B / longest`` tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from tandem.gateway.errors import APIError, bad_request
from tandem.gateway.sampling import max_tokens_for
from tandem.gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from tandem.text.tokenizer import Tokenizer

# Normalizers may shrink text a little before it is split (NFKC, stripped controls): the
# bound allows twice the strict figure so that no prompt that fits is ever refused by it.
SIZE_BOUND_SLACK = 2


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """400 unless every id is in ``[0, vocab_size)``."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"{param} contains token id {t}, outside the vocabulary [0, {vocab_size})",
                              param=param, code="invalid_token_id")


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """UTF-8 bytes of the vocabulary's longest entry (added and special tokens included)."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        data = tokenizer.raw_token_bytes(i)
        if data is None:
            data = (tokenizer.id_to_token(i) or "").encode()
        longest = max(longest, len(data))
    return longest


def max_prompt_bytes(tokenizer: Tokenizer, max_model_len: int) -> int:
    """Prompt text longer than this (UTF-8 bytes) has more tokens than the context holds."""
    return max_model_len * longest_token_bytes(tokenizer) * SIZE_BOUND_SLACK


def _too_long(size: int, limit: int, max_model_len: int, param: str) -> APIError:
    return bad_request(f"the prompt has {size} bytes of text, more than this model's maximum context length of "
                       f"{max_model_len} tokens can hold", param=param, code="context_length_exceeded")


def _encode_checked(tokenizer: Tokenizer, text: str, add_special_tokens: bool, vocab_size: int,
                    max_model_len: int, param: str) -> list[int]:
    encoding = tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    # the context check before the ids become a Python list (which holds the GIL)
    max_tokens_for(None, len(encoding), max_model_len, default=1, prompt_param=param)
    ids = encoding.ids
    check_token_ids(ids, vocab_size, param)  # a tokenizer may know more tokens than the model
    return ids


async def _off_loop(func: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(func, *args)


async def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer, vocab_size: int, max_prompts: int,
                             max_model_len: int) -> list[list[int]]:
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
    texts = [item for item in items if isinstance(item, str)]
    if texts:
        limit = await _off_loop(max_prompt_bytes, tokenizer, max_model_len)
        for text in texts:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit:
                raise _too_long(size, limit, max_model_len, "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", param="prompt")
            ids = await _off_loop(_encode_checked, tokenizer, item, True, vocab_size, max_model_len, "prompt")
        else:
            ids = list(item)
            check_token_ids(ids, vocab_size, "prompt")
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        out.append(ids)
    return out


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # text parts (the schema admits no other kind)
        d["content"] = "\n".join(part.text for part in m.content)
    return d


def _encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], vocab_size: int,
                 max_model_len: int) -> list[int]:
    try:  # special-token text inside a message stays plain text
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from e
    max_tokens_for(None, len(ids), max_model_len, default=1, prompt_param="messages")
    check_token_ids(ids, vocab_size, "messages")
    return ids


async def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int,
                      max_model_len: int) -> list[int]:
    """Token ids of the rendered chat template (its text already holds BOS and the like)."""
    messages = [_message_dict(m) for m in req.messages]
    size = sum(len(str(v).encode("utf-8", "surrogatepass")) for m in messages for v in m.values())
    limit = await _off_loop(max_prompt_bytes, tokenizer, max_model_len)
    if size > limit:
        raise _too_long(size, limit, max_model_len, "messages")
    ids = await _off_loop(_encode_chat, tokenizer, messages, vocab_size, max_model_len)
    if not ids:
        raise bad_request("the chat template rendered an empty prompt", param="messages")
    return ids
