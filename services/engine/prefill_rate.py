"""How fast a worker computes prompt tokens, as its recent steps measured it."""

from __future__ import annotations


class PrefillRate:
    """Prompt tokens per second over a worker's recent steps that computed any.

    A decaying ratio of sums (tokens over seconds, each step weighted by ``1 -
    decay`` and older ones by powers of ``decay``), so a short step counts as
    much as its length and the figure follows a change of thread count or of
    CPU share within a few steps. ``tokens_per_s`` is 0.0 until a step was
    observed. Not thread-safe: one owner (the engine thread) observes; readers
    take the published float.
    """

    def __init__(self, decay: float = 0.75) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """One step that computed ``prompt_tokens`` prompt tokens in ``seconds`` (wall)."""
        if prompt_tokens <= 0 or seconds <= 0.0:
            return
        keep = self.decay
        self._tokens = keep * self._tokens + (1.0 - keep) * prompt_tokens
        self._seconds = keep * self._seconds + (1.0 - keep) * seconds

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0.0 else 0.0
