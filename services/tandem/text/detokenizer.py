"""Incremental detokenization with stop strings.

Turns generated token ids into text one token at a time, emitting only text that is
final: never half a UTF-8 character, never text that may still turn out to be part
of a stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tandem.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Per-sequence streaming detokenizer.

    ``add(token_id)`` returns ``(text, stopped)``: the text safe to emit now, and whether a
    stop string was hit (the text then ends just before it, or just after it with
    ``include_stop_str_in_output``; later tokens are ignored). ``flush()`` releases what is
    still held back at the end of generation. Without a stop hit, everything returned by
    ``add`` and ``flush`` concatenates to ``tokenizer.decode(ids, skip_special_tokens)``.

    Where several stop strings match, the one that completes first (earliest end) wins,
    as it would if text arrived one character at a time; ties go to the earliest start.
    ``stop_after``: stop strings count only in the text of the tokens after the first
    ``stop_after`` (``min_tokens``); earlier text is emitted as it comes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        stop_after: int = 0,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._tok = tokenizer
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._stop_after = stop_after
        self._num_added = 0
        self._byte_level = tokenizer.is_byte_level
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # fallback path: decode a window of ids [prefix_offset:], emit past read_offset's text
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""  # decoded text held back for stop-string matching
        self._out: list[str] = []
        self._stopped = False
        self._matched: str | None = None
        self._flushed = False

    # -------------------------------------------------------------- properties
    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._out) > 1:
            self._out = ["".join(self._out)]
        return self._out[0] if self._out else ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string was hit."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended generation, if any."""
        return self._matched

    # ---------------------------------------------------------------- feeding
    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated token; return (new text safe to emit, stopped)."""
        if self._stopped:
            return "", True
        if self._flushed:
            raise RuntimeError("add() after flush()")
        self._num_added += 1
        new = self._decode_byte_level(token_id) if self._byte_level else self._decode_window(token_id)
        return self._emit(new, final=False), self._stopped

    def flush(self) -> str:
        """End of generation: release held text (incomplete UTF-8 becomes U+FFFD)."""
        if self._stopped or self._flushed:
            return ""
        self._flushed = True
        if self._byte_level:
            tail = self._utf8.decode(b"", final=True)
        else:
            tail = self._window_text(final=True)
        return self._emit(tail, final=True)

    # --------------------------------------------------------------- decoding
    def _decode_byte_level(self, token_id: int) -> str:
        if self._tok.is_special(token_id):
            if self._skip_special:
                return ""
            data = self._tok.raw_token_bytes(token_id)
        else:
            data = self._tok.token_bytes(token_id)
        if data is None:  # id outside the tokenizer's vocabulary: decode() drops it too
            return ""
        return self._utf8.decode(data)

    def _decode_window(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._window_text(final=False)

    def _window_text(self, *, final: bool) -> str:
        skip = self._skip_special
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if final or (len(full) > len(prefix) and not full.endswith(_REPLACEMENT)):
            # text may end in U+FFFD at a split character: wait for the rest of it
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    # ----------------------------------------------------------- stop strings
    def _emit(self, new: str, *, final: bool) -> str:
        buf = self._pending + new
        if not buf:
            return ""
        if not self._stop or self._num_added <= self._stop_after:
            self._out.append(buf)
            self._pending = ""
            return buf
        # Held text is the only place a stop string can begin (emitted text never could).
        hit = self._find_stop(buf)
        if hit is not None:
            start, end, s = hit
            out = buf[: end if self._include_stop else start]
            self._pending = ""
            self._stopped = True
            self._matched = s
        else:
            hold = 0 if final else self._held_suffix_len(buf)
            out = buf[: len(buf) - hold]
            self._pending = buf[len(buf) - hold :]
        if out:
            self._out.append(out)
        return out

    def _find_stop(self, buf: str) -> tuple[int, int, str] | None:
        """(start, end, stop string) of the first stop string to complete in ``buf``."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            i = buf.find(s)  # for one string, earliest start is earliest end
            if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
                best = (i, i + len(s), s)
        return best

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(buf), len(s) - 1), longest, -1):
                if s.startswith(buf[-k:]):
                    longest = k
                    break
        return longest
