"""Logprobs in OpenAI's two shapes: completions (parallel lists) and chat (``content`` entries)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tandem.protocol.request_path import TokenLogprob
from tandem.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI-compatible servers clamp like this


def clamp(logprob: float) -> float:
    """A finite logprob for JSON (``-inf``/NaN become :data:`LOGPROB_FLOOR`)."""
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenStrings:
    """Each token's string and bytes as logprob entries show them (cached).

    A token that is not whole UTF-8 (a byte-level piece of a character) shows as
    ``bytes:\\xe6\\x97`` like OpenAI does; ``bytes`` always holds the exact bytes.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int], int]] = {}

    def get(self, token_id: int) -> tuple[str, list[int], int]:
        """(string, bytes, length in output characters) of ``token_id``."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        data = self._tok.raw_token_bytes(token_id)
        if data is None:
            data = self._tok.decode([token_id], skip_special_tokens=False).encode()
        try:
            text = data.decode("utf-8")
            width = len(text)
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            width = len(data.decode("utf-8", "ignore"))
        entry = (text, list(data), width)
        if len(self._cache) < 1 << 20:
            self._cache[token_id] = entry
        return entry


def completion_logprobs(strings: TokenStrings, lps: Sequence[TokenLogprob], num_top: int,
                        offset: int) -> tuple[dict[str, Any], int]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` and the next text offset.

    ``top_logprobs`` maps token strings to logprobs: the ``num_top`` most likely, plus the
    sampled token (so ``logprobs: 0`` still names it).
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        text, _, width = strings.get(lp.token_id)
        tokens.append(text)
        token_lps.append(clamp(lp.logprob))
        top = {strings.get(t)[0]: clamp(v) for t, v in lp.top[:num_top]}
        top.setdefault(text, clamp(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += width
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(strings: TokenStrings, lps: Sequence[TokenLogprob], num_top: int) -> list[dict[str, Any]]:
    """``logprobs.content`` entries: ``{"token", "logprob", "bytes", "top_logprobs"}``."""
    out = []
    for lp in lps:
        text, data, _ = strings.get(lp.token_id)
        top = []
        for t, v in lp.top[:num_top]:
            s, b, _ = strings.get(t)
            top.append({"token": s, "logprob": clamp(v), "bytes": b})
        out.append({"token": text, "logprob": clamp(lp.logprob), "bytes": data, "top_logprobs": top})
    return out
