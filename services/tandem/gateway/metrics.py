"""The gateway's /metrics: its own request families merged with the cluster's and workers'."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from tandem.common.metrics import GatewayMetrics


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render(registries: Iterable[CollectorRegistry], extra: Iterable[Metric]) -> bytes:
    """One exposition of every family, samples of same-named families merged (one HELP/TYPE)."""
    merged: dict[str, Metric] = {}
    for fam in itertools.chain(*(r.collect() for r in registries), extra):
        into = merged.get(fam.name)
        if into is None:
            into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        into.samples.extend(fam.samples)
    out = CollectorRegistry(auto_describe=False)
    out.register(_Families(list(merged.values())))
    return generate_latest(out)


def default_registries(own: CollectorRegistry) -> list[CollectorRegistry]:
    """The gateway's registry plus the process collectors of the default one."""
    return [own, REGISTRY]


CLIENT_CLOSED = 499  # nginx's "client closed request"


def count_error(metrics: GatewayMetrics | None, status: int) -> None:
    """A request answered with an error status (before or during its stream)."""
    if metrics is not None:
        metrics.requests.labels(finish_reason="error", status=str(status)).inc()


class ChoiceClock:
    """Latency bookkeeping of one sequence, observed into the gateway's histograms."""

    def __init__(self, metrics: GatewayMetrics | None, started: float | None = None) -> None:
        self.m = metrics
        self.started = started if started is not None else time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def tokens_out(self, n: int) -> None:
        """``n`` tokens reached the gateway now."""
        if self.m is None or n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.started)
            n_gaps = n - 1
        else:
            n_gaps = n
        if n_gaps and self.last is not None:
            gap = (now - self.last) / n_gaps  # coalesced tokens share the gap
            for _ in range(n_gaps):
                self.m.itl.observe(gap)
        self.last = now
        self.tokens += n
        self.m.generation_tokens.inc(n)

    def finished(self, finish_reason: str, status: int, prompt_tokens: int = 0) -> None:
        if self.m is None:
            return
        now = time.monotonic()
        self.m.requests.labels(finish_reason=finish_reason, status=str(status)).inc()
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.e2e.observe(now - self.started)
        if self.first is not None and self.tokens > 1:
            self.m.tpot.observe((now - self.first) / (self.tokens - 1))
