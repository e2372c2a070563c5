"""CPU contention in ``tandem plan``'s simulation: workers, the frontend and other processes
share the cores by weight (Linux CFS), no thread faster than one core."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What the workers run on: ``cores`` shared by all, ``threads`` per worker."""

    cores: float
    threads: int = 1
    prefill_nice: int = 0
    background_cores: float = 0.0  # other processes' CPU
    server_idle_cores: float = 0.0  # the server's own CPU at rest (load polls, Ray), paid at any rate
    # CPU the whole request path spends per streamed token outside the engine steps
    # (gateway, client, Ray, the workers' own threads), the part below included
    frontend_s_per_token: float = 0.0
    # what a served worker's step takes longer per token it emits than the profiled step
    # (its outputs handed to the token feed, its Ray threads holding the GIL meanwhile)
    step_s_per_token: float = 0.0

    @property
    def outside_workers_s_per_token(self) -> float:
        """The request path's CPU per token that the workers' steps do not already spend."""
        return max(0.0, self.frontend_s_per_token - self.step_s_per_token)


@dataclass
class Job:
    """A CPU consumer: ``remaining`` seconds of work at full speed, wanting ``threads`` cores."""

    threads: float
    weight: float
    remaining: float = 0.0
    rate: float = 0.0


def share_cores(jobs: Sequence[Job], cores: float) -> None:
    """Set each busy job's ``rate`` (share of full speed): weighted fair sharing of ``cores``,
    no thread above one core (water-filling)."""
    open_ = [j for j in jobs if j.threads > 0]
    for j in jobs:
        j.rate = 0.0
    cap = cores
    while open_:
        total = sum(j.threads * j.weight for j in open_)
        level = cap / total if total > 0 else math.inf
        full = [j for j in open_ if j.weight * level >= 1.0]
        if not full:
            for j in open_:
                j.rate = j.weight * level
            return
        for j in full:
            j.rate = 1.0
            cap -= j.threads
            open_.remove(j)


def nice_weight(nice: int) -> float:
    """Linux CFS: each niceness step is ~1.25x less CPU weight."""
    return 1.25 ** -nice
