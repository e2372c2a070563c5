"""A started server's CPU outside its engine steps: at rest, and on the request path.

Shared by ``tandem plan --validate`` and ``tandem bench request-path``: the server's CPU
at rest (load polls, Ray) over ``IDLE_S``; the engine counters its ``/metrics`` serves
(every worker's engine-step CPU and steps); the request path's CPU over a stretch of
serving (the server's process tree and the client, less the engine steps and the CPU at
rest); and the split of that CPU into a cost per engine step and one per token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.bench.metrics_math import lstsq_nonneg
from tandem.cluster.telemetry import DEFAULT_INTERVAL_S

IDLE_S = 3.0  # how long a started server's CPU at rest is measured
TELEMETRY_WAIT_S = DEFAULT_INTERVAL_S + 0.5  # /metrics serves the workers' counters as last refreshed


def idle_cores(pid: int) -> float:
    """Cores the process tree of ``pid`` (a started server) uses at rest, once it went quiet."""
    from tandem.bench.cpu_load import tree_cpu_seconds, wait_until_idle

    wait_until_idle(pid)
    rest0 = tree_cpu_seconds(pid)
    time.sleep(IDLE_S)
    return (tree_cpu_seconds(pid) - rest0) / IDLE_S


@dataclass(frozen=True)
class EngineCounters:
    """The workers' engine counters as a server's ``/metrics`` has them, summed per worker
    role: role -> (tandem_engine_step_cpu_seconds_total, tandem_engine_steps_total)."""

    by_role: dict[str, tuple[float, float]]

    @property
    def step_cpu_s(self) -> float:
        return sum(cpu for cpu, _ in self.by_role.values())

    @property
    def steps(self) -> float:
        return sum(n for _, n in self.by_role.values())

    def since(self, before: EngineCounters) -> dict[str, tuple[float, float]]:
        """Per role, the step CPU and steps counted after ``before``."""
        out = {}
        for role, (cpu, n) in self.by_role.items():
            cpu0, n0 = before.by_role.get(role, (0.0, 0.0))
            out[role] = (cpu - cpu0, n - n0)
        return out


def engine_counters(url: str) -> EngineCounters | None:
    """The server's engine counters (None when its ``/metrics`` cannot be read)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    names = ("tandem_engine_step_cpu_seconds", "tandem_engine_steps")
    by_role: dict[str, list[float]] = {}
    for f in text_string_to_metric_families(text):
        if f.name in names:
            for s in f.samples:
                if s.name.endswith("_total"):
                    by_role.setdefault(s.labels.get("role", ""), [0.0, 0.0])[names.index(f.name)] += s.value
    return EngineCounters({role: (c, n) for role, (c, n) in by_role.items()})


def path_cpu_s(tree_s: float, client_s: float, before: EngineCounters, after: EngineCounters,
               idle: float, seconds: float) -> float:
    """The request path's CPU over ``seconds`` of serving: the server's process tree
    (``tree_s``) and the client's (``client_s``), less its engine steps' CPU and its
    CPU at rest (``idle`` cores) over that time."""
    return tree_s + client_s - (after.step_cpu_s - before.step_cpu_s) - idle * seconds


def fit_per_step_and_token(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(per_step_s, per_token_s)`` from ``(steps, tokens, path CPU seconds)`` points: least
    squares, both >= 0. ValueError unless the points have two ratios of steps to tokens."""
    if len({round(steps / tokens, 3) for steps, tokens, _ in points if tokens}) < 2:
        raise ValueError("a per-step / per-token split needs two ratios of steps to tokens")
    a = np.array([[steps, tokens] for steps, tokens, _ in points], dtype=float)
    per_step, per_token = lstsq_nonneg(a, np.array([cpu for _, _, cpu in points], dtype=float))
    return float(per_step), float(per_token)
