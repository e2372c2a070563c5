"""Verification of point-mass drafts by resampling: exact, and seed-for-seed identical.

A speculating sequence with draft ``d_1 .. d_k`` has its target logits scored at
``k + 1`` positions in one forward pass: position ``j`` sees the committed tokens
plus ``d_1 .. d_j``. Each position is sampled exactly as a plain decode step
would sample it, as if the draft before it had been accepted (same penalties
over the same output so far, same min_tokens bans, same seeded draw keyed by the
same output index). Then, walking ``j = 0, 1, ...``: the sample ``t_j`` is
committed; if ``t_j == d_{j+1}`` the next position is valid too, otherwise the
walk stops there (``t_j`` is the correction), and after ``k`` matches ``t_k`` is a
bonus token.

Why this is exact rejection sampling for a deterministic draft: the draft's
distribution is a point mass on ``d``; the standard rule accepts ``d`` with
probability ``min(1, p(d) / 1) = p(d)`` and on rejection samples from ``p`` with
``d`` removed and renormalised. Drawing ``t ~ p`` and accepting iff ``t == d``
accepts with probability ``p(d)``, and given ``t != d``, ``t`` is distributed as
``p`` restricted to ``V \\ {d}``: the same law. Greedy rows reduce to prefix
matching against the argmax.

Because every committed token is the very sample the non-speculative sampler
would draw at that output index, outputs are token-identical with speculation on
and off for greedy requests and for requests with a ``seed`` (the seeded draw
is a pure function of (seed, output index)). Unseeded random requests draw from
the engine's shared generator, which rejected positions also consume, so they
are identically distributed but not the same stream as without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class DraftPrefix(Sequence[int]):
    """``base + extra`` as a read-only sequence, without copying ``base``.

    The output so far of a verified position: committed output tokens plus the
    draft tokens ahead of that position.
    """

    __slots__ = ("base", "extra")

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self.base = base
        self.extra = extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __iter__(self) -> Iterator[int]:
        yield from self.base
        yield from self.extra

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self.base)
        if i < 0:
            i += len(self)
        return self.base[i] if i < n else self.extra[i - n]


def accepted_length(samples: Sequence[int], draft: Sequence[int]) -> int:
    """How many of ``samples`` (one per verified position, ``len(draft) + 1``) commit.

    The longest prefix of the draft matched by the samples, plus the sample
    after it (the correction or, after a full match, the bonus token).
    """
    if len(samples) != len(draft) + 1:
        raise ValueError(f"{len(samples)} samples for a draft of {len(draft)} tokens: "
                         f"need one per draft token plus one")
    n = 0
    while n < len(draft) and samples[n] == draft[n]:
        n += 1
    return n + 1
