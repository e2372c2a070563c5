"""Writes the Grafana dashboards of deploy/grafana/dashboards/ (services/ARCHITECTURE.md, "Metrics").

The JSON files are generated, not hand-edited: change this file, then run

    .venv/bin/python deploy/grafana/generate.py

from the repository root. tests/unit/test_dashboards.py fails when the committed
JSON differs from what this script writes, when a query names a metric that
services/tandem/common/metrics.py does not export, or when a query does not parse.

Conventions:
- every panel and query uses the datasource template variable ``${datasource}``;
- rates use ``$__rate_interval`` (set the datasource's scrape interval, 5s, in
  provisioning so that Grafana computes it right);
- SLO thresholds are template variables whose options are the histogram bucket
  boundaries (``le`` label values as prometheus_client writes them), because a
  fraction of observations under a threshold is exact only at a boundary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "dashboards"
if str(ROOT / "services") not in sys.path:  # the source tree, installed or not
    sys.path.insert(0, str(ROOT / "services"))

from prometheus_client.utils import floatToGoString  # noqa: E402

from tandem.common.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS  # noqa: E402

DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
SCHEMA_VERSION = 39
DEFAULT_SLO_TTFT = "2.5"  # seconds; the alert rules use the same SLO
DEFAULT_SLO_TPOT = "0.1"  # seconds per output token


# ---------------------------------------------------------------------------
# building blocks


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref,
         "range": not instant, "instant": instant}
    return t


def _targets(queries) -> list[dict]:
    out = []
    for i, q in enumerate(queries):
        expr, legend = q if isinstance(q, tuple) else (q, "")
        out.append(target(expr, legend, ref=chr(ord("A") + i)))
    return out


def _thresholds(steps) -> dict:
    # Grafana always treats the first step as -Infinity (and saves it as null); a
    # number is written here so that the file validates with nulls stripped.
    return {"mode": "absolute",
            "steps": [{"color": c, "value": v} for c, v in steps]}


GREEN = [("green", 0)]


def timeseries(title: str, queries, unit: str = "short", description: str = "",
               w: int = 12, h: int = 8, min_=None, max_=None, stack: bool = False,
               thresholds=None) -> dict:
    defaults = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 30,
                   "showPoints": "never", "spanNulls": False, "axisSoftMin": 0,
                   "stacking": {"mode": "normal" if stack else "none", "group": "A"}},
        "thresholds": _thresholds(thresholds or GREEN),
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "_size": (w, h),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                               "calcs": ["mean", "lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": _targets(queries),
    }


def stat(title: str, queries, unit: str = "short", description: str = "", w: int = 4,
         h: int = 4, thresholds=None, decimals=None) -> dict:
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": _thresholds(thresholds or GREEN)}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat", "title": title, "description": description, "datasource": DS,
        "_size": (w, h),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                    "orientation": "auto", "textMode": "auto"},
        "targets": _targets(queries),
    }


def row(title: str, panels: list[dict], collapsed: bool = False) -> dict:
    return {"type": "row", "title": title, "collapsed": collapsed, "_children": panels}


def layout(rows: list[dict]) -> list[dict]:
    """Assigns ids and grid positions (24 columns); panels of a collapsed row nest in it."""
    out: list[dict] = []
    next_id = 1
    y = 0
    for r in rows:
        children = r.pop("_children")
        r["id"] = next_id
        next_id += 1
        r["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
        r["panels"] = []
        y += 1
        out.append(r)
        top = y
        x, row_h = 0, 0
        for p in children:
            w, h = p.pop("_size")
            if x + w > 24:
                x, y = 0, y + row_h
                row_h = 0
            p["id"] = next_id
            next_id += 1
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            x += w
            row_h = max(row_h, h)
            (r["panels"] if r["collapsed"] else out).append(p)
        # A collapsed row's panels keep their positions for when it opens; the next row
        # starts right under the collapsed header.
        y = top if r["collapsed"] else y + row_h
    return out


def datasource_var() -> dict:
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "current": {"selected": True, "text": "Prometheus",
                                               "value": "prometheus"},
            "hide": 0, "refresh": 1, "regex": "", "skipUrlSync": False, "options": []}


def custom_var(name: str, label: str, values: list[str], default: str, description: str) -> dict:
    return {"name": name, "label": label, "type": "custom", "description": description,
            "query": ",".join(values),
            "current": {"selected": True, "text": default, "value": default},
            "options": [{"selected": v == default, "text": v, "value": v} for v in values],
            "hide": 0, "multi": False, "includeAll": False, "skipUrlSync": False}


def query_var(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": query, "definition": query,
            "current": {"selected": True, "text": "All", "value": "$__all"},
            "options": [], "hide": 0, "multi": True, "includeAll": True, "allValue": ".*",
            "refresh": 2, "regex": "", "sort": 1, "skipUrlSync": False}


def dashboard(uid: str, title: str, description: str, rows: list[dict], variables: list[dict],
              tags: list[str]) -> dict:
    return {
        "uid": uid, "title": title, "description": description,
        "tags": ["tandem", *tags], "timezone": "browser", "editable": True,
        "graphTooltip": 1, "schemaVersion": SCHEMA_VERSION, "version": 1,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m"]},
        "fiscalYearStartMonth": 0, "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [{"title": "tandem", "type": "dashboards", "tags": ["tandem"], "asDropdown": True,
                   "includeVars": False, "keepTime": True, "icon": "external link",
                   "targetBlank": False, "tooltip": "", "url": ""}],
        "templating": {"list": variables},
        "panels": layout(rows),
    }


def quantiles(metric: str, by: str = "", qs=(0.5, 0.9, 0.99), extra: str = "") -> list[tuple]:
    """histogram_quantile targets: p50/p90/p99 of ``metric``, summed by ``le`` (and ``by``)."""
    group = f"{by}, le" if by else "le"
    sel = f"{metric}_bucket{{{extra}}}" if extra else f"{metric}_bucket"
    legend_by = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(",")) if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({sel}[{RI}])))",
             f"p{int(q * 100)} {legend_by}".strip()) for q in qs]


# ---------------------------------------------------------------------------
# tandem-overview

TTFT = "tandem_time_to_first_token_seconds"
TPOT = "tandem_time_per_output_token_seconds"
ITL = "tandem_inter_token_latency_seconds"
E2E = "tandem_e2e_request_latency_seconds"

OK_REQUESTS = f'sum(rate(tandem_requests_total{{status=~"2.."}}[{RI}]))'
ALL_REQUESTS = f"sum(rate(tandem_requests_total[{RI}]))"
TTFT_OK = (f'sum(rate({TTFT}_bucket{{le="$slo_ttft"}}[{RI}])) / '
           f"sum(rate({TTFT}_count[{RI}]))")
TPOT_OK = (f'sum(rate({TPOT}_bucket{{le="$slo_tpot"}}[{RI}])) / '
           f"sum(rate({TPOT}_count[{RI}]))")
GOODPUT = f"{OK_REQUESTS} * ({TTFT_OK}) * ({TPOT_OK})"

GOODPUT_DESCRIPTION = (
    "Goodput: requests per second that finished with a 2xx status AND met both SLOs, "
    "TTFT <= $slo_ttft s and TPOT <= $slo_tpot s (template variables; their choices are the "
    "histograms' bucket boundaries).\n\n"
    "Prometheus holds TTFT and TPOT in two separate histograms, so the share of requests that "
    "met both at once cannot be read exactly. From the buckets we read, exactly at a bucket "
    "boundary, a = share of TTFT observations <= $slo_ttft (bucket le=\"$slo_ttft\" / count) "
    "and b = share of TPOT observations <= $slo_tpot. The estimate is "
    "rate(2xx requests) * a * b, which assumes the two are independent. The true goodput lies "
    "between the bounds also drawn: rate * max(0, a + b - 1) (worst case: the misses never "
    "overlap) and rate * min(a, b) (best case: they always overlap). Requests with a single "
    "output token have no TPOT observation; b is taken over those that have one.")


def overview() -> dict:
    slo_ttft = custom_var("slo_ttft", "TTFT SLO (s)", [floatToGoString(b) for b in LATENCY_BUCKETS],
                          DEFAULT_SLO_TTFT, "Time-to-first-token SLO: a bucket boundary of "
                          f"{TTFT}")
    slo_tpot = custom_var("slo_tpot", "TPOT SLO (s)", [floatToGoString(b) for b in TOKEN_BUCKETS],
                          DEFAULT_SLO_TPOT, "Time-per-output-token SLO: a bucket boundary of "
                          f"{TPOT}")
    ratio_steps = [("red", 0), ("orange", 0.9), ("green", 0.99)]
    rows = [
        row("Traffic", [
            stat("Request rate", [(ALL_REQUESTS, "req/s")], unit="reqps",
                 description="Finished requests per second, all statuses."),
            stat("In-flight requests", [("sum(tandem_gateway_requests_in_flight)", "in flight")],
                 description="Requests the gateway is serving right now."),
            stat("Goodput", [(GOODPUT, "goodput")], unit="reqps",
                 description=GOODPUT_DESCRIPTION),
            stat("Goodput ratio", [(f"({GOODPUT}) / {ALL_REQUESTS}", "goodput / all")],
                 unit="percentunit", thresholds=ratio_steps, decimals=1,
                 description="Estimated goodput (see the Goodput panel) over all finished "
                             "requests."),
            stat("Error ratio (5xx)",
                 [(f'sum(rate(tandem_requests_total{{status=~"5.."}}[{RI}])) / {ALL_REQUESTS}',
                   "5xx")],
                 unit="percentunit", decimals=2,
                 thresholds=[("green", 0), ("orange", 0.01), ("red", 0.05)],
                 description="Share of finished requests answered with a 5xx status."),
            stat("Generation tokens/s",
                 [(f"sum(rate(tandem_generation_tokens_total[{RI}]))", "tokens/s")],
                 description="Tokens streamed to clients per second."),
            timeseries("Requests/s by status",
                       [(f"sum by (status) (rate(tandem_requests_total[{RI}]))", "{{status}}")],
                       unit="reqps", stack=True,
                       description="Finished requests per second by HTTP status."),
            timeseries("Requests/s by finish reason",
                       [(f"sum by (finish_reason) (rate(tandem_requests_total[{RI}]))",
                         "{{finish_reason}}")],
                       unit="reqps", stack=True,
                       description="Finished requests per second by finish reason."),
            timeseries("In-flight requests",
                       [("sum(tandem_gateway_requests_in_flight)", "gateway in flight")],
                       description="Requests the gateway is serving (gauge)."),
            timeseries("Tokens/s",
                       [(f"sum(rate(tandem_prompt_tokens_total[{RI}]))", "prompt"),
                        (f"sum(rate(tandem_generation_tokens_total[{RI}]))", "generation")],
                       description="Prompt tokens of finished requests and tokens streamed, "
                                   "per second."),
        ]),
        row("Latency", [
            timeseries("Time to first token", [
                *quantiles(TTFT), ("vector($slo_ttft)", "SLO")], unit="s",
                description="Request arrival to first token at the gateway: p50/p90/p99 from "
                            f"{TTFT}, and the TTFT SLO."),
            timeseries("Time per output token", [
                *quantiles(TPOT), ("vector($slo_tpot)", "SLO")], unit="s",
                description="Per request (e2e - TTFT) / (output tokens - 1): p50/p90/p99, and "
                            "the TPOT SLO."),
            timeseries("Inter-token latency", quantiles(ITL), unit="s",
                       description="Gap between consecutive streamed tokens: p50/p90/p99."),
            timeseries("End-to-end latency", quantiles(E2E), unit="s",
                       description="Request arrival to last token: p50/p90/p99."),
        ]),
        row("Goodput (SLO)", [
            timeseries("Goodput against the SLO", [
                (GOODPUT, "goodput (estimate)"),
                (f"{OK_REQUESTS} * clamp_min(({TTFT_OK}) + ({TPOT_OK}) - 1, 0)",
                 "goodput lower bound"),
                (f"{OK_REQUESTS} * clamp_max(({TTFT_OK}), scalar({TPOT_OK}))",
                 "goodput upper bound"),
                (OK_REQUESTS, "2xx requests"),
            ], unit="reqps", description=GOODPUT_DESCRIPTION),
            timeseries("SLO attainment", [
                (TTFT_OK, "TTFT <= $slo_ttft s"),
                (TPOT_OK, "TPOT <= $slo_tpot s"),
            ], unit="percentunit", min_=0, max_=1,
                description="Share of TTFT (and TPOT) observations at or under the SLO, read "
                            "from the bucket le equal to the SLO over the _count."),
        ]),
        row("Errors", [
            timeseries("Errors/s by status",
                       [(f'sum by (status) (rate(tandem_requests_total{{status!~"2.."}}[{RI}]))',
                         "{{status}}")],
                       unit="reqps", stack=True,
                       description="Finished requests with a non-2xx status per second."),
            timeseries("Error ratio", [
                (f'sum(rate(tandem_requests_total{{status=~"5.."}}[{RI}])) / {ALL_REQUESTS}', "5xx"),
                (f'sum(rate(tandem_requests_total{{status=~"4.."}}[{RI}])) / {ALL_REQUESTS}', "4xx"),
            ], unit="percentunit", min_=0,
                description="Share of finished requests answered 5xx (server) and 4xx (client)."),
        ]),
        row("Mean latencies", [
            timeseries("Mean TTFT and e2e", [
                (f"sum(rate({TTFT}_sum[{RI}])) / sum(rate({TTFT}_count[{RI}]))", "TTFT mean"),
                (f"sum(rate({E2E}_sum[{RI}])) / sum(rate({E2E}_count[{RI}]))", "e2e mean"),
            ], unit="s", description="Means from the histograms' _sum / _count."),
            timeseries("Mean TPOT and ITL", [
                (f"sum(rate({TPOT}_sum[{RI}])) / sum(rate({TPOT}_count[{RI}]))", "TPOT mean"),
                (f"sum(rate({ITL}_sum[{RI}])) / sum(rate({ITL}_count[{RI}]))", "ITL mean"),
            ], unit="s", description="Means from the histograms' _sum / _count."),
        ], collapsed=True),
    ]
    return dashboard("tandem-overview", "tandem / Overview",
                     "Request rate, latency percentiles, goodput against an SLO, errors.",
                     rows, [datasource_var(), slo_ttft, slo_tpot], ["overview"])


# ---------------------------------------------------------------------------
# tandem-pools

SEL = 'role=~"$role", worker=~"$worker"'


def pools() -> dict:
    variables = [
        datasource_var(),
        query_var("role", "Role", "label_values(tandem_num_requests_running, role)"),
        query_var("worker", "Worker",
                  'label_values(tandem_num_requests_running{role=~"$role"}, worker)'),
    ]
    per_worker = "{{role}} {{worker}}"
    rows = [
        row("Pools", [
            stat("Workers ready", [("sum by (role) (tandem_workers_ready)", "{{role}}")], w=6,
                 thresholds=[("red", 0), ("green", 1)],
                 description="Workers answering, per pool role (prefill, decode, both). A pool "
                             "at 0 cannot serve."),
            stat("Remote prefill share",
                 [(f'sum(rate(tandem_prefill_decisions_total{{decision="remote"}}[{RI}])) / '
                   f"sum(rate(tandem_prefill_decisions_total[{RI}]))", "remote")],
                 unit="percentunit", w=6, decimals=1,
                 description="Share of routing decisions that prefilled on a prefill worker "
                             "(decision=remote) rather than on the decode worker."),
            stat("Running", [(f"sum by (role) (tandem_num_requests_running{{{SEL}}})", "{{role}}")],
                 w=6, description="Sequences in the running batches, per role."),
            stat("Waiting", [(f"sum by (role) (tandem_num_requests_waiting{{{SEL}}})", "{{role}}")],
                 w=6, thresholds=[("green", 0), ("orange", 10), ("red", 100)],
                 description="Sequences waiting for prefill, per role."),
            timeseries("Running vs waiting by role", [
                (f"sum by (role) (tandem_num_requests_running{{{SEL}}})", "running {{role}}"),
                (f"sum by (role) (tandem_num_requests_waiting{{{SEL}}})", "waiting {{role}}"),
            ], description="Queue depth against batch occupancy: a growing waiting line on one "
                           "role marks the bottleneck pool."),
            timeseries("Prefill decisions/s", [
                (f"sum by (decision) (rate(tandem_prefill_decisions_total[{RI}]))", "{{decision}}"),
            ], unit="ops", stack=True,
                description="Router decisions per second: remote (prefill pool, KV pushed to "
                            "decode) versus the local_* reasons (decode worker prefills) and "
                            "colocated."),
            timeseries("Workers ready by role", [
                ("sum by (role) (tandem_workers_ready)", "{{role}}"),
            ], min_=0, description="Workers answering, per pool role."),
            timeseries("KV cache usage by role", [
                (f"avg by (role) (tandem_kv_cache_usage_ratio{{{SEL}}})", "avg {{role}}"),
                (f"max by (role) (tandem_kv_cache_usage_ratio{{{SEL}}})", "max {{role}}"),
            ], unit="percentunit", min_=0, max_=1,
                description="Share of KV blocks in use: average and fullest worker per role."),
        ]),
        row("Per worker", [
            timeseries("Running per worker",
                       [(f"tandem_num_requests_running{{{SEL}}}", per_worker)],
                       description="Sequences in each worker's running batch."),
            timeseries("Waiting per worker",
                       [(f"tandem_num_requests_waiting{{{SEL}}}", per_worker)],
                       description="Sequences waiting for prefill on each worker."),
            timeseries("KV cache usage per worker",
                       [(f"tandem_kv_cache_usage_ratio{{{SEL}}}", per_worker)],
                       unit="percentunit", min_=0, max_=1,
                       thresholds=[("green", 0), ("red", 0.95)],
                       description="Share of each worker's KV blocks in use."),
            timeseries("KV cache free blocks per worker",
                       [(f"tandem_kv_cache_free_blocks{{{SEL}}}", per_worker)], min_=0,
                       description="Free KV blocks on each worker."),
            timeseries("Preemptions/s per worker",
                       [(f"sum by (role, worker) (rate(tandem_preemptions_total{{{SEL}}}[{RI}]))",
                         per_worker)], unit="ops",
                       description="Sequences preempted for recompute (KV cache pressure)."),
            timeseries("Speculative decoding per worker", [
                (f"sum by (role, worker) (rate(tandem_spec_accepted_tokens_total{{{SEL}}}[{RI}])) / "
                 f"sum by (role, worker) (rate(tandem_spec_proposed_tokens_total{{{SEL}}}[{RI}]))",
                 "acceptance rate " + per_worker),
                (f"sum by (role, worker) (rate(tandem_spec_acceptance_length_sum{{{SEL}}}[{RI}])) / "
                 f"sum by (role, worker) (rate(tandem_spec_acceptance_length_count{{{SEL}}}[{RI}]))",
                 "accepted per draft " + per_worker),
            ], min_=0,
                description="Speculative decoding (tandem serve --speculative): share of draft "
                            "tokens the target accepted, and draft tokens accepted per verified "
                            "draft (each verification also commits one token of the target's "
                            "own). Empty when speculation is off."),
            timeseries("Engine steps/s per worker",
                       [(f"sum by (role, worker) (rate(tandem_engine_steps_total{{{SEL}}}[{RI}]))", per_worker)],
                       unit="ops", min_=0,
                       description="Forward passes each worker's engine runs per second."),
            timeseries("Engine busy per worker",
                       [(f"sum by (role, worker) (rate(tandem_engine_step_cpu_seconds_total{{{SEL}}}[{RI}]))"
                         f" / sum by (role, worker) (tandem_worker_threads{{{SEL}}})", per_worker)],
                       unit="percentunit", min_=0,
                       description="CPU each worker's engine steps use (its thread and the OpenMP "
                                   "helpers they run on) as a share of its torch threads' cores: near "
                                   "1, the worker is saturated; the rest of its CPU is the request "
                                   "path."),
            timeseries("Torch threads per worker",
                       [(f"tandem_worker_threads{{{SEL}}}", per_worker)], min_=0,
                       description="Torch threads each worker's engine steps run with: "
                                   "--threads-per-worker, or sized to the host or the worker's Ray "
                                   "node; a decode worker's rises while it bursts (no prefill "
                                   "pending for it), a prefill worker's while nothing decodes."),
        ]),
        row("Pool latency", [
            timeseries("Queue time by role",
                       quantiles("tandem_queue_time_seconds", by="role", extra=SEL), unit="s",
                       description="Arrival at the worker to first scheduled step: "
                                   "p50/p90/p99 per role."),
            timeseries("Prefill time by role",
                       quantiles("tandem_prefill_time_seconds", by="role", extra=SEL), unit="s",
                       description="First scheduled step to first token (prompt compute): "
                                   "p50/p90/p99 per role."),
        ]),
        row("Moves between decode workers", [
            timeseries("Moves by outcome", [
                (f"sum by (outcome) (rate(tandem_migrations_total[{RI}]))", "{{outcome}}"),
            ], unit="ops", min_=0,
                description="Running requests moved to another decode worker with their KV "
                            "(drains, rebalancing): migrated; failed (stayed where they were); "
                            "fell back (re-driven: prefilled again)."),
            timeseries("Pause clients saw across a move",
                       quantiles("tandem_migration_pause_seconds"), unit="s",
                       description="The longest gap between two tokens of a moved stream: "
                                   "p50/p90/p99."),
            timeseries("KV moved", [
                (f"sum(rate(tandem_migration_kv_bytes_total[{RI}]))", "bytes/s"),
            ], unit="Bps", min_=0, description="KV bytes copied between decode workers by moves."),
        ]),
        row("Resilience", [
            timeseries("Re-drives and replacements", [
                (f"sum(rate(tandem_request_migrations_total[{RI}]))", "re-drives/s"),
                (f"sum(rate(tandem_worker_replacements_total[{RI}]))", "worker replacements/s"),
            ], unit="ops",
                description="Requests re-driven on another worker after a failure (prompt and "
                            "tokens so far prefilled again), and dead workers replaced."),
            stat("Re-drives in range",
                 [("sum(increase(tandem_request_migrations_total[$__range]))", "re-drives")],
                 w=6, description="Requests re-driven over the dashboard's time range."),
            stat("Replacements in range",
                 [("sum(increase(tandem_worker_replacements_total[$__range]))", "replacements")],
                 w=6, description="Workers replaced over the dashboard's time range."),
        ], collapsed=True),
    ]
    return dashboard("tandem-pools", "tandem / Pools",
                     "Prefill pool against decode pool: load, queues, KV cache, preemptions, "
                     "routing decisions, readiness.", rows, variables, ["pools"])


# ---------------------------------------------------------------------------
# tandem-transfer

KV = "tandem_kv_transfer_seconds"


def transfer() -> dict:
    variables = [
        datasource_var(),
        query_var("role", "Role", "label_values(tandem_kv_transfer_bytes_total, role)"),
        query_var("worker", "Worker",
                  'label_values(tandem_kv_transfer_bytes_total{role=~"$role"}, worker)'),
    ]
    per_worker = "{{role}} {{worker}}"
    rows = [
        row("KV transfer", [
            stat("KV sent", [(f'sum(rate(tandem_kv_transfer_bytes_total{{role="prefill"}}[{RI}]))',
                              "sent")], unit="Bps", w=6,
                 description="KV bytes per second sent by the prefill pool."),
            stat("KV received",
                 [(f'sum(rate(tandem_kv_transfer_bytes_total{{role="decode"}}[{RI}]))',
                   "received")], unit="Bps", w=6,
                 description="KV bytes per second received by the decode pool."),
            stat("Transfers/s", [(f"sum(rate({KV}_count{{{SEL}}}[{RI}]))", "transfers/s")],
                 unit="ops", w=6, description="Completed KV transfers per second."),
            stat("Failures in range",
                 [(f"sum(increase(tandem_kv_transfer_failures_total{{{SEL}}}[$__range]))",
                   "failures")], w=6, thresholds=[("green", 0), ("red", 1)], decimals=0,
                 description="KV transfers that failed or timed out over the time range."),
            timeseries("KV bytes/s per worker", [
                (f"sum by (role, worker) (rate(tandem_kv_transfer_bytes_total{{{SEL}}}[{RI}]))",
                 per_worker)], unit="Bps",
                description="KV bytes sent (prefill workers) or received (decode workers) per "
                            "second."),
            timeseries("KV bytes/s sent vs received", [
                (f"sum by (role) (rate(tandem_kv_transfer_bytes_total[{RI}]))", "{{role}}"),
            ], unit="Bps",
                description="Pool totals: in steady state the prefill pool sends what the "
                            "decode pool receives."),
            timeseries("Transfer latency by role", quantiles(KV, by="role", extra=SEL), unit="s",
                       description="Duration of one request's KV transfer: p50/p90/p99."),
            timeseries("Transfer failures/s per worker", [
                (f"sum by (role, worker) (rate(tandem_kv_transfer_failures_total{{{SEL}}}[{RI}]))",
                 per_worker)], unit="ops",
                description="KV transfers that failed or timed out, per second."),
            timeseries("Mean transfer size", [
                (f"sum by (role) (rate(tandem_kv_transfer_bytes_total{{{SEL}}}[{RI}])) / "
                 f"sum by (role) (rate({KV}_count{{{SEL}}}[{RI}]))", "bytes/transfer {{role}}"),
            ], unit="bytes",
                description="KV bytes per completed transfer (bytes rate over transfers rate)."),
            timeseries("Effective transfer bandwidth", [
                (f"sum by (role) (rate(tandem_kv_transfer_bytes_total{{{SEL}}}[{RI}])) / "
                 f"sum by (role) (rate({KV}_sum{{{SEL}}}[{RI}]))", "{{role}}"),
            ], unit="Bps",
                description="Bytes moved per second of transfer time (bytes rate over the rate "
                            "of summed transfer durations): the link speed a transfer sees."),
            timeseries("Failure ratio", [
                (f"sum by (role) (rate(tandem_kv_transfer_failures_total{{{SEL}}}[{RI}])) / "
                 f"(sum by (role) (rate({KV}_count{{{SEL}}}[{RI}])) + "
                 f"sum by (role) (rate(tandem_kv_transfer_failures_total{{{SEL}}}[{RI}])))",
                 "{{role}}")], unit="percentunit", min_=0,
                description="Failures over failures plus completed transfers (assumes a failed "
                            "transfer is not also observed in the duration histogram)."),
        ]),
        row("Per-worker latency", [
            timeseries("Transfer latency p90 per worker", [
                (f"histogram_quantile(0.9, sum by (role, worker, le) "
                 f"(rate({KV}_bucket{{{SEL}}}[{RI}])))", per_worker)], unit="s",
                description="p90 KV transfer duration per worker."),
            timeseries("Transfers/s per worker", [
                (f"sum by (role, worker) (rate({KV}_count{{{SEL}}}[{RI}]))", per_worker)],
                unit="ops", description="Completed KV transfers per second, per worker."),
        ], collapsed=True),
    ]
    return dashboard("tandem-transfer", "tandem / KV transfer",
                     "KV cache transfer from the prefill pool to the decode pool: throughput, "
                     "latency, failures.", rows, variables, ["transfer"])


DASHBOARDS = {"tandem-overview.json": overview, "tandem-pools.json": pools,
              "tandem-transfer.json": transfer}


def render() -> dict[str, str]:
    """File name -> JSON text, as written to dashboards/."""
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
