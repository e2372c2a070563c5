"""How fast a worker computes prompt tokens, as its recent steps measured it."""

from __future__ import annotations


class PrefillRate:
    """Prompt tokens per second over a worker's recent steps that computed any, per
    thread count (a worker whose count changes between steps, ``ElasticThreads``, runs
    at two speeds).

    For each count a decaying ratio of sums (tokens over seconds, each step weighted by
    ``1 - decay`` and older ones by powers of ``decay``), so a short step counts as much
    as its length and the figure follows a change of CPU share within a few steps. Not
    thread-safe: one owner (the engine thread) observes and reads.
    """

    def __init__(self, decay: float = 0.75) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self._sums: dict[int, tuple[float, float]] = {}  # threads -> (tokens, seconds)
        self._last_threads: int | None = None

    def observe(self, prompt_tokens: int, seconds: float, threads: int = 1) -> None:
        """One step that computed ``prompt_tokens`` prompt tokens in ``seconds`` (wall)
        on ``threads`` threads."""
        if prompt_tokens <= 0 or seconds <= 0.0:
            return
        keep = self.decay
        tokens, secs = self._sums.get(threads, (0.0, 0.0))
        self._sums[threads] = (keep * tokens + (1.0 - keep) * prompt_tokens,
                               keep * secs + (1.0 - keep) * seconds)
        self._last_threads = threads

    def tokens_per_s(self, threads: int = 1) -> float:
        """The rate at ``threads`` threads; the last measured count's where that count
        has none; 0.0 before any step was observed."""
        sums = self._sums.get(threads)
        if sums is None:
            if self._last_threads is None:
                return 0.0
            sums = self._sums[self._last_threads]
        return sums[0] / sums[1]
