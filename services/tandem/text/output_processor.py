"""The output processor: one request's generated tokens turned into what a user receives.

The engine knows only token ids: it stops a sequence on EOS, on a stop token id or
at its length limit. Everything that needs text lives here, in one place, for the
offline ``LLM`` and the HTTP gateway alike:

- incremental detokenization (never half a UTF-8 character);
- stop strings (held-back text, ``include_stop_str_in_output``), counted only in the
  text of tokens after the first ``min_tokens``;
- the text of an EOS or stop token is never output (an engine ``stop`` always ends
  with the token that caused it);
- the finish reason (a stop-string hit is ``stop``; otherwise the engine's);
- the tokens and logprobs that belong to the output (cut where a stop string ended it).

A stop-string hit finishes the output while the engine still runs the request: the
caller must abort it there (``TextDelta.stopped_by_text``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.text.detokenizer import IncrementalDetokenizer
from tandem.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDelta:
    """What one batch of new tokens adds to the output.

    ``token_ids`` (and ``logprobs``, one per token) are the tokens that count, cut
    after the token that completed a stop string. ``finish_reason`` is set on the
    output's last delta.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Any, ...] | None
    finish_reason: FinishReason | None = None
    stopped_by_text: bool = False  # a stop string ended it: abort the engine request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Per-output (one choice of one request) text state; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer, stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, stop_after=params.min_tokens)
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The whole output text so far."""
        return self._detok.text

    def process(self, token_ids: Sequence[int], finish_reason: FinishReason | None = None,
                logprobs: Sequence[Any] | None = None) -> TextDelta:
        """Take the engine's next tokens (and its finish reason, if they end the request)."""
        if self.finished:
            raise RuntimeError("process() after the output finished")
        tokens = tuple(token_ids)
        # The engine's `stop` comes with the EOS / stop token that caused it: not output as text.
        hidden = int(finish_reason is FinishReason.STOP and bool(tokens))
        parts: list[str] = []
        used, reason, by_text = len(tokens), None, False
        for i in range(len(tokens) - hidden):
            text, stopped = self._detok.add(tokens[i])
            if text:
                parts.append(text)
            if stopped:
                used, reason, by_text = i + 1, FinishReason.STOP, True
                break
        if reason is None and finish_reason is not None:
            if finish_reason is not FinishReason.ABORT:
                parts.append(self._detok.flush())
            reason = finish_reason
        self.finish_reason = reason
        lps = tuple(logprobs[:used]) if logprobs is not None else None
        return TextDelta("".join(parts), tokens[:used], lps, reason, by_text)
