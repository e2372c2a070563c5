"""Elastic torch threads for a decode worker that shares a CPU host with prefill workers.

On a CPU host the pools share cores. A decode worker pinned to one thread leaves the
prefill workers' cores idle whenever no prompt is being prefilled, and a decode worker
with every core's worth of threads fights the prefill workers for them while one is.
``ElasticThreads`` picks per moment: ``burst`` threads while no remote prefill is
pending for this worker (none reserved whose KV has not arrived), ``base`` otherwise.

Thread counts in OpenMP are per calling thread, so the count is applied on the engine
loop's thread, between steps (``EngineLoop.submit``); a step already running finishes
with the count it started with.
"""

from __future__ import annotations

import torch


class ElasticThreads:
    """The decode engine's thread count: ``burst`` while no prefill is pending, else ``base``.

    ``burst <= base`` turns it off (the count stays ``base``).
    """

    def __init__(self, base: int, burst: int) -> None:
        if base < 1:
            raise ValueError(f"base threads must be >= 1, got {base}")
        if burst < 0:
            raise ValueError(f"burst threads must be >= 0, got {burst}")
        self.base, self.burst = base, max(base, burst)
        self.current: int | None = None  # unknown until first applied on the loop thread
        self.switches = 0  # how often the count changed (a counter for stats)

    @property
    def enabled(self) -> bool:
        return self.burst > self.base

    def wanted(self, prefill_pending: int) -> int:
        """Threads for the next steps given how many remote prefills are pending."""
        return self.base if prefill_pending > 0 else self.burst

    def apply(self, prefill_pending: int) -> int:
        """Set the calling thread's torch thread count (call on the engine loop thread)."""
        n = self.wanted(prefill_pending)
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n
            self.switches += 1
        return n
