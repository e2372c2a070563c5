"""Draft proposers: guess the next tokens of a sequence cheaply, for the target to verify.

A proposer returns a *deterministic* draft (a point mass per position), which is
what verification by resampling (``verifier.py``) needs to stay exact. One that
spends compute per drafted token says how much with a ``draft_cost`` attribute
(relative to a target decode step; absent means free), which the adaptive
policy charges (``speculator.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tandem.engine.sequence import Sequence as EngineSequence


class Proposer(Protocol):
    def propose(self, seq_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (prompt + output); may be empty.

        Between calls a sequence's tokens only grow (a shorter stream starts over).
        """
        ...

    def drop(self, seq_id: str) -> None:
        """Forget a sequence's state (it finished or was aborted)."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that drafts for the whole step at once (a draft model's batched forward)."""

    def propose_batch(self, requests: Sequence[tuple[EngineSequence, int]]) -> dict[str, list[int]]:
        """Drafts by sequence id for each ``(sequence, k)``; a sequence may get none."""
        ...

    def drop(self, seq_id: str) -> None:
        ...


class _NgramIndex:
    """Latest start of the continuation after each n-gram of one token stream.

    ``last[n][gram] = i`` means ``tokens[i - n:i] == gram`` for the largest such
    ``i`` seen, counting only grams that end before the stream's last token, so a
    lookup of the stream's own suffix never finds itself.
    """

    def __init__(self, ns: range) -> None:
        self.ns = ns
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ns}
        self.indexed = 0  # continuation starts < this are in the maps

    def update(self, tokens: Sequence[int]) -> None:
        end = len(tokens)  # continuation starts < end: up to the last token
        if end < self.indexed:  # the stream shrank: start over
            self.last = {n: {} for n in self.ns}
            self.indexed = 0
        for i in range(self.indexed, end):
            for n, table in self.last.items():
                if i >= n:
                    table[tuple(tokens[i - n:i])] = i
        self.indexed = max(self.indexed, end)


def _continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start``; past the end, the repeat that the match implies.

    A match whose continuation reaches the end of the stream says the stream
    repeats with period ``len(tokens) - start``, so the draft keeps copying its own
    tokens (a loop of any length is drafted in full).
    """
    out = list(tokens[start:min(start + k, len(tokens))])
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


class NgramProposer:
    """Prompt lookup: find the longest recent n-gram match of the suffix, copy what followed.

    Tries ``ngram_max`` down to ``ngram_min``; the most recent earlier occurrence
    wins, and a match always yields ``k`` tokens (see ``_continuation``). Per
    sequence, an incremental index makes each call cost O(new tokens).
    """

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ns = range(ngram_max, ngram_min - 1, -1)
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, seq_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(token_ids) < self.ns.stop + 2:
            return []
        index = self._index.get(seq_id)
        if index is None:
            index = self._index[seq_id] = _NgramIndex(self.ns)
        index.update(token_ids)
        total = len(token_ids)
        for n in self.ns:
            if n >= total:
                continue
            start = index.last[n].get(tuple(token_ids[total - n:]))
            if start is not None:
                return _continuation(token_ids, start, k)
        return []

    def drop(self, seq_id: str) -> None:
        self._index.pop(seq_id, None)
