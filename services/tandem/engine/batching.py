"""The continuous-batching rule: the order a step serves its running sequences in, and how
its token budget and sequence slots are shared.

The engine's scheduler (``scheduler.Scheduler.schedule``) and the planner's simulated worker
(``tandem.planner.sim_worker``) both batch by these functions, so a change here moves the
plan's predictions with the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def running_order(running: Iterable[T], uncomputed: Callable[[T], int]) -> list[T]:
    """The running sequences in the order a step serves them: decodes (one token to compute)
    before prompt chunks, so a long prefill chunk never starves them; otherwise as queued."""
    return sorted(running, key=lambda s: uncomputed(s) > 1)


class StepBudget:
    """One step's token budget and sequence slots."""

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.left = max_tokens
        self.max_seqs = max_seqs

    def share(self, need: int) -> int:
        """The tokens a sequence needing ``need`` gets of what is left (chunked prefill)."""
        return min(need, self.left)

    def spend(self, n: int) -> None:
        self.left -= n

    def admits(self, num_running: int) -> bool:
        """Whether a waiting sequence may join a batch of ``num_running``: budget left and a slot."""
        return self.left > 0 and num_running < self.max_seqs
