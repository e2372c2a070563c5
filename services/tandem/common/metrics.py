"""Prometheus metric definitions (services/ARCHITECTURE.md, "Metrics"): one place names every family.

The gateway process owns the request-level families; each worker owns its
engine and transfer families in its own registry, labelled ``role`` and
``worker``, and the gateway's ``/metrics`` merges them in, so one scrape target
covers the whole cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "tandem_"
# Latency buckets spanning GPU (sub-millisecond steps) and CPU (seconds-long prefills).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                   1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                 0.25, 0.5, 1.0, 2.5, 5.0)
WORKER_LABELS = ("role", "worker")
ACCEPTANCE_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


@dataclass
class GatewayMetrics:
    requests: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    running: Gauge


def gateway_metrics(registry: CollectorRegistry | None = None) -> GatewayMetrics:
    """Request-level families, observed in the gateway process."""
    r = registry if registry is not None else CollectorRegistry()
    return GatewayMetrics(
        requests=Counter(f"{PREFIX}requests", "Finished requests by finish reason and HTTP status",
                         ("finish_reason", "status"), registry=r),
        prompt_tokens=Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests",
                              registry=r),
        generation_tokens=Counter(f"{PREFIX}generation_tokens", "Tokens streamed to clients",
                                  registry=r),
        ttft=Histogram(f"{PREFIX}time_to_first_token_seconds", "Request arrival to first token",
                       buckets=LATENCY_BUCKETS, registry=r),
        itl=Histogram(f"{PREFIX}inter_token_latency_seconds", "Gap between consecutive tokens",
                      buckets=TOKEN_BUCKETS, registry=r),
        tpot=Histogram(f"{PREFIX}time_per_output_token_seconds",
                       "Per request: (e2e - TTFT) / (output tokens - 1)",
                       buckets=TOKEN_BUCKETS, registry=r),
        e2e=Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request arrival to last token",
                      buckets=LATENCY_BUCKETS, registry=r),
        running=Gauge(f"{PREFIX}gateway_requests_in_flight", "Requests the gateway is serving",
                      registry=r),    )


@dataclass
class WorkerMetrics:
    queue_time: Histogram
    prefill_time: Histogram
    kv_transfer_time: Histogram
    kv_transfer_bytes: Counter
    kv_transfer_failures: Counter
    preemptions: Counter
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    free_blocks: Gauge
    spec_proposed_tokens: Counter
    spec_accepted_tokens: Counter
    spec_acceptance_length: Histogram
    step_cpu: Counter
    steps: Counter
    threads: Gauge


def worker_metrics(role: str, worker: str,
                   registry: CollectorRegistry | None = None) -> tuple[WorkerMetrics, CollectorRegistry]:
    """Engine and transfer families of one worker, already bound to its labels."""
    r = registry if registry is not None else CollectorRegistry()
    labels = dict(role=role, worker=worker)

    def bind(metric):
        return metric.labels(**labels)

    m = WorkerMetrics(
        queue_time=bind(Histogram(f"{PREFIX}queue_time_seconds", "Arrival to first scheduled step",
                                  WORKER_LABELS, buckets=LATENCY_BUCKETS, registry=r)),
        prefill_time=bind(Histogram(f"{PREFIX}prefill_time_seconds",
                                    "First scheduled step to first token (prompt compute)",
                                    WORKER_LABELS, buckets=LATENCY_BUCKETS, registry=r)),
        kv_transfer_time=bind(Histogram(f"{PREFIX}kv_transfer_seconds",
                                        "Duration of one request's KV transfer",
                                        WORKER_LABELS, buckets=LATENCY_BUCKETS, registry=r)),
        kv_transfer_bytes=bind(Counter(f"{PREFIX}kv_transfer_bytes",
                                       "KV bytes sent (prefill) or received (decode)",
                                       WORKER_LABELS, registry=r)),
        kv_transfer_failures=bind(Counter(f"{PREFIX}kv_transfer_failures",
                                          "KV transfers that failed or timed out",
                                          WORKER_LABELS, registry=r)),
        preemptions=bind(Counter(f"{PREFIX}preemptions", "Sequences preempted for recompute",
                                 WORKER_LABELS, registry=r)),
        running=bind(Gauge(f"{PREFIX}num_requests_running", "Sequences in the running batch",
                           WORKER_LABELS, registry=r)),
        waiting=bind(Gauge(f"{PREFIX}num_requests_waiting", "Sequences waiting for prefill",
                           WORKER_LABELS, registry=r)),
        kv_usage=bind(Gauge(f"{PREFIX}kv_cache_usage_ratio", "Share of KV blocks in use",
                            WORKER_LABELS, registry=r)),
        free_blocks=bind(Gauge(f"{PREFIX}kv_cache_free_blocks", "Free KV blocks",
                               WORKER_LABELS, registry=r)),
        spec_proposed_tokens=bind(Counter(f"{PREFIX}spec_proposed_tokens",
                                          "Speculative draft tokens sent to verification",
                                          WORKER_LABELS, registry=r)),
        spec_accepted_tokens=bind(Counter(f"{PREFIX}spec_accepted_tokens",
                                          "Speculative draft tokens the target accepted",
                                          WORKER_LABELS, registry=r)),
        spec_acceptance_length=bind(Histogram(
            f"{PREFIX}spec_acceptance_length",
            "Draft tokens accepted per verified draft (the step commits one more)",
            WORKER_LABELS, buckets=ACCEPTANCE_BUCKETS, registry=r)),
        step_cpu=bind(Counter(f"{PREFIX}engine_step_cpu_seconds",
                              "CPU seconds the engine's steps spent: its thread and the OpenMP "
                              "helper threads they ran on; the rest of a worker's CPU is the request path",
                              WORKER_LABELS, registry=r)),
        steps=bind(Counter(f"{PREFIX}engine_steps", "Engine steps run (each a forward pass)",
                           WORKER_LABELS, registry=r)),
        threads=bind(Gauge(f"{PREFIX}worker_threads", "Torch threads the engine's steps run with "
                           "now (changes while a worker bursts into the other pool's idle cores)",
                           WORKER_LABELS, registry=r)),
    )
    return m, r


MIGRATION_OUTCOMES = ("migrated", "failed", "fell_back")


@dataclass
class MigrationMetrics:
    """Moves of running requests between decode workers, observed in the gateway process:
    ``migrated`` (moved with their KV), ``failed`` (stayed where they were), ``fell_back``
    (re-driven: prefilled again elsewhere, after a failed move on a drain)."""

    moves: Counter
    pause: Histogram
    kv_bytes: Counter


def migration_metrics(registry: CollectorRegistry | None = None) -> MigrationMetrics:
    r = registry if registry is not None else CollectorRegistry()
    m = MigrationMetrics(
        moves=Counter(f"{PREFIX}migrations", "Moves of running requests between decode workers, "
                      "by outcome", ("outcome",), registry=r),
        pause=Histogram(f"{PREFIX}migration_pause_seconds", "Longest gap between two tokens a "
                        "client saw across a move", buckets=LATENCY_BUCKETS, registry=r),
        kv_bytes=Counter(f"{PREFIX}migration_kv_bytes", "KV bytes copied by moves",
                         registry=r))
    for outcome in MIGRATION_OUTCOMES:
        m.moves.labels(outcome)  # each outcome exported from the start, at 0
    return m


def cluster_families(decisions: dict[str, int], redrives: int, replacements: int,
                     ready: dict[str, int]) -> list[Metric]:
    """Counts the cluster keeps (router decisions, re-drives, replacements, live workers)."""
    dec = CounterMetricFamily(f"{PREFIX}prefill_decisions",
                              "Where each request's prompt was prefilled (router decisions)",
                              labels=("decision",))
    for decision, count in sorted(decisions.items()):
        dec.add_metric((decision,), count)
    mig = CounterMetricFamily(f"{PREFIX}request_migrations",
                              "Requests re-driven on another worker after a failure")
    mig.add_metric((), redrives)
    rep = CounterMetricFamily(f"{PREFIX}worker_replacements", "Dead workers replaced")
    rep.add_metric((), replacements)
    live = GaugeMetricFamily(f"{PREFIX}workers_ready", "Workers answering, by pool role",
                             labels=("role",))
    for role, count in sorted(ready.items()):
        live.add_metric((role,), count)
    return [dec, mig, rep, live]


def exported_names() -> set[str]:
    """Every sample name the code can export (dashboards and rules are checked against it)."""
    names: set[str] = set()
    registries = [CollectorRegistry(), worker_metrics("prefill", "w")[1], CollectorRegistry()]
    gateway_metrics(registries[0])
    migration_metrics(registries[2])
    families = [f for reg in registries for f in reg.collect()]
    families += cluster_families({"remote": 0}, 0, 0, {"decode": 0})
    for family in families:
        base = family.name
        if family.type == "counter":
            names |= {f"{base}_total", f"{base}_created"}
        elif family.type == "histogram":
            names |= {f"{base}_bucket", f"{base}_count", f"{base}_sum", f"{base}_created"}
        else:
            names.add(base)
    return names
