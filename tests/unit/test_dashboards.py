"""The Grafana dashboards and the Prometheus rules, checked against the code
(services/ARCHITECTURE.md, "Metrics").

- every dashboard validates against tests/schemas/grafana-dashboard.schema.json (nulls
  stripped, each panel checked as `Panel` or `RowPanel` by its type, rows' panels included);
- every PromQL expression (dashboard targets and variable queries, rule `expr`s) names only
  metrics that services/tandem/common/metrics.py exports (rules may also name the series they record
  and Prometheus's own `up`);
- every expression parses as PromQL: with Prometheus's own parser (`promtool check rules` on a
  generated rules file; Debian package `prometheus`) and with `promql-parser` (PyPI) where
  installed;
- the committed JSON is what deploy/grafana/generate.py writes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft7Validator
from prometheus_client import CollectorRegistry

from tandem.common.metrics import exported_names, gateway_metrics, worker_metrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
SCHEMA_PATH = ROOT / "tests" / "schemas" / "grafana-dashboard.schema.json"
EXPECTED_DASHBOARDS = ("tandem-overview.json", "tandem-pools.json", "tandem-transfer.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Series Prometheus writes itself for every target: rules may use them, dashboards may not.
PROMETHEUS_SYNTHETIC = {"up"}
# Grafana's global variables, with stand-in values for parsing.
GRAFANA_GLOBALS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h",
                   "__interval_ms": "60000", "__range_s": "3600", "__range_ms": "3600000"}


# ---------------------------------------------------------------------------
# metric names in PromQL: a tokenizer


AGGREGATORS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
               "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = LABEL_LIST_KEYWORDS | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan",
                                  "start", "end"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
                     r"(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[^\]]*\]\]")


def _skip_string(s: str, i: int) -> int:
    """Index just past the string literal that starts at s[i]."""
    quote = s[i]
    i += 1
    while i < len(s):
        if s[i] == "\\" and quote != "`":
            i += 2
            continue
        if s[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated string in {s!r}")


def _skip_group(s: str, i: int, close: str) -> tuple[int, str]:
    """Index just past the bracket that closes the one at s[i], and the text inside."""
    opener = s[i]
    depth, j = 0, i
    while j < len(s):
        c = s[j]
        if c in "\"'`":
            j = _skip_string(s, j)
            continue
        if c == opener:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1, s[i + 1:j]
        j += 1
    raise ValueError(f"unbalanced {opener!r} in {s!r}")


def _next_nonspace(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects.

    Skips string literals, label matchers inside {...}, ranges and subqueries inside [...],
    label lists after by/without/on/ignoring/group_left/group_right, function and aggregation
    names, keywords, numbers and durations, and Grafana template variables ($x, ${x}, [[x]]).
    A `__name__` matcher is refused: the name would hide in a string.
    """
    names: set[str] = set()
    s, i = expr, 0
    while i < len(s):
        c = s[i]
        if c.isspace() or c in "()+-*/%^,=!<>@":
            i += 1
        elif c == "#":
            end = s.find("\n", i)
            i = len(s) if end < 0 else end
        elif c in "\"'`":
            i = _skip_string(s, i)
        elif c == "{":
            i, inside = _skip_group(s, i, "}")
            if re.search(r"(^|[\s,{])__name__\s*(=|!=|=~|!~)", inside):
                raise ValueError(f"__name__ matcher in {expr!r}: name the metric instead")
        elif c == "[":
            i, _ = _skip_group(s, i, "]")
        elif c == "$":
            m = _VARIABLE.match(s, i)
            if not m:
                raise ValueError(f"stray '$' at {i} in {expr!r}")
            i = m.end()
        elif c.isdigit() or (c == "." and i + 1 < len(s) and s[i + 1].isdigit()):
            i = _NUMBER.match(s, i).end()
        elif _IDENT.match(s, i):
            word = _IDENT.match(s, i).group()
            i += len(word)
            j = _next_nonspace(s, i)
            nxt = s[j] if j < len(s) else ""
            lower = word.lower()
            if lower in LABEL_LIST_KEYWORDS:
                if nxt == "(":
                    i, _ = _skip_group(s, j, ")")
            elif lower in KEYWORDS:
                pass
            elif nxt == "(":
                pass  # a function or an aggregation: its arguments are scanned next
            elif word in AGGREGATORS and _IDENT.match(s, j) and \
                    _IDENT.match(s, j).group().lower() in {"by", "without"}:
                pass  # `sum by (le) (...)`
            else:
                names.add(word)
        else:
            raise ValueError(f"unexpected {c!r} at {i} in {expr!r}")
    return names


def unknown_metrics(expr: str, allowed: set[str]) -> set[str]:
    return metric_names(expr) - allowed


# ---------------------------------------------------------------------------
# the artifacts


@functools.cache
def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


@functools.cache
def rule_files() -> dict[str, dict]:
    files = sorted([*RULES_DIR.glob("*.yml"), *RULES_DIR.glob("*.yaml")])
    return {p.name: yaml.safe_load(p.read_text()) for p in files}


def all_rules() -> list[tuple[str, dict]]:
    return [(f"{name}: {group['name']}", rule) for name, doc in rule_files().items()
            for group in doc["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for _, rule in all_rules() if "record" in rule}


def panels(dashboard: dict):
    """Every panel, the panels nested in rows included."""
    for p in dashboard.get("panels", []):
        yield p
        if p.get("type") == "row":
            yield from p.get("panels", [])


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def substitute(expr: str, dashboard: dict, choose=None) -> str:
    """The expression with Grafana's variables replaced as Grafana would (current values)."""
    defined = variables(dashboard)

    def value(m: re.Match) -> str:
        text = m.group()
        name = text.strip("$[]{}").split(":")[0]
        if name in GRAFANA_GLOBALS:
            return GRAFANA_GLOBALS[name]
        if name not in defined:
            raise AssertionError(f"{expr!r} uses ${name}, which the dashboard does not define")
        if choose and name in choose:
            return choose[name]
        var = defined[name]
        current = var.get("current", {}).get("value")
        if current in ("$__all", ["$__all"]):
            return var.get("allValue", ".*")
        if isinstance(current, list):
            current = current[0]
        assert current is not None, f"variable {name} has no current value"
        return current

    return _VARIABLE.sub(value, expr)


LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.+),)?\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$",
                          re.S)
QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.+)\)\s*$", re.S)


def variable_query_expr(var: dict) -> str | None:
    """The PromQL inside a Prometheus query variable (label_values / query_result), if any."""
    query = var.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    if not query:
        return None
    if m := LABEL_VALUES.match(query):
        return m.group("selector")
    if m := QUERY_RESULT.match(query):
        return m.group("expr")
    raise AssertionError(f"variable {var['name']}: unsupported query {query!r}")


def dashboard_exprs(name: str) -> list[tuple[str, str]]:
    """(where, raw expression) for every target and query variable of one dashboard."""
    d = dashboards()[name]
    out = []
    for p in panels(d):
        for t in p.get("targets", []):
            out.append((f"{name} panel {p.get('id')} {p.get('title')!r} {t.get('refId')}",
                        t["expr"]))
    for var in variables(d).values():
        if var.get("type") == "query" and (expr := variable_query_expr(var)):
            out.append((f"{name} variable {var['name']}", expr))
    return out


def parse_cases() -> list[tuple[str, str]]:
    """(where, expression ready to parse): dashboards' with variables substituted, and rules'."""
    cases = []
    for name in dashboards():
        for where, expr in dashboard_exprs(name):
            cases.append((where, substitute(expr, dashboards()[name])))
    for where, rule in all_rules():
        cases.append((f"{where}: {rule.get('record') or rule.get('alert')}", rule["expr"]))
    return cases


def strip_nulls(value):
    if isinstance(value, dict):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_nulls(v) for v in value if v is not None]
    return value


def histogram_les() -> dict[str, set[str]]:
    """`le` label values of each exported histogram's _bucket series, as the code writes them."""
    registries = [CollectorRegistry(), worker_metrics("prefill", "w")[1]]
    gateway_metrics(registries[0])
    les: dict[str, set[str]] = {}
    for reg in registries:
        for family in reg.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    les.setdefault(sample.name, set()).add(sample.labels["le"])
    return les


# ---------------------------------------------------------------------------
# the tokenizer itself


@pytest.mark.parametrize("expr, expected", [
    ("tandem_workers_ready", {"tandem_workers_ready"}),
    ('histogram_quantile(0.9, sum by (le, role) (rate(a_bucket{role=~"$role", le!="x"}[$__rate_interval])))',
     {"a_bucket"}),
    ("sum(rate(a_total[5m])) by (job) / ignoring (status) group_left (le) b", {"a_total", "b"}),
    ("a and on (worker) b or c unless d", {"a", "b", "c", "d"}),
    ("a > bool 0.5 + 1e-9 - 0x1F * Inf / NaN", {"a"}),
    ("max_over_time(a[1h:5m] offset 1h30m) @ start()", {"a"}),
    ('label_replace(a, "dst", "sum_rate_fake", "src", "(.*)")', {"a"}),
    ("sum without (worker) (a) # a comment naming fake_metric", {"a"}),
    ("vector($slo_ttft) + ${x} * [[y]]", set()),
    ("topk(3, count by (role) (a:recorded:rate5m))", {"a:recorded:rate5m"}),
    ("sum\n  by (le)\n  (a)", {"a"}),
    ("-a ^ 2 % b", {"a", "b"}),
])
def test_metric_names_tokenizer(expr, expected):
    assert metric_names(expr) == expected


def test_checker_catches_made_up_metric():
    allowed = exported_names()
    good = "sum(rate(tandem_requests_total[5m]))"
    assert unknown_metrics(good, allowed) == set()
    bad = ('histogram_quantile(0.9, sum by (le) (rate(tandem_time_to_first_token_seconds_bucket[5m]))) '
           '/ on () tandem_made_up_seconds')
    assert unknown_metrics(bad, allowed) == {"tandem_made_up_seconds"}
    # A histogram's family name is not itself a series: only _bucket/_sum/_count are.
    assert unknown_metrics("rate(tandem_time_to_first_token_seconds[5m])", allowed) == \
        {"tandem_time_to_first_token_seconds"}
    # A counter without its _total suffix is not exported either.
    assert unknown_metrics("rate(tandem_requests[5m])", allowed) == {"tandem_requests"}
    with pytest.raises(ValueError, match="__name__"):
        metric_names('{__name__="tandem_anything"}')


def test_tokenizer_agrees_with_promql_parser():
    """The tokenizer finds the same names as a real PromQL AST, on every checked expression."""
    pp = pytest.importorskip("promql_parser", reason="promql-parser (PyPI) not installed")
    for where, expr in parse_cases():
        found: set[str] = set()

        def visit(node):
            if isinstance(node, pp.VectorSelector) and node.name:
                found.add(node.name)

        pp.walk(pp.parse(expr), visit)
        assert metric_names(expr) == found, where


# ---------------------------------------------------------------------------
# dashboards


def test_dashboards_present():
    assert set(EXPECTED_DASHBOARDS) <= set(dashboards()), sorted(dashboards())


def test_dashboards_are_generated():
    spec = importlib.util.spec_from_file_location("tandem_grafana_generate", GRAFANA / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stale = [name for name, text in gen.render().items()
             if not (DASHBOARD_DIR / name).exists() or (DASHBOARD_DIR / name).read_text() != text]
    assert not stale, (f"{stale} differ from deploy/grafana/generate.py's output: run "
                       ".venv/bin/python deploy/grafana/generate.py")


@pytest.mark.parametrize("name", EXPECTED_DASHBOARDS)
def test_dashboard_validates_against_schema(name):
    assert SCHEMA_PATH.exists(), f"{SCHEMA_PATH} missing (tests/schemas)"
    schema = json.loads(SCHEMA_PATH.read_text())
    definitions = schema["definitions"]

    def validator(definition: str) -> Draft7Validator:
        return Draft7Validator({"$ref": f"#/definitions/{definition}", "definitions": definitions})

    dashboard = strip_nulls(dashboards()[name])
    # The panels are checked one by one below, each by its type (the schema's anyOf would
    # only say that a panel matches neither).
    top = {k: v for k, v in dashboard.items() if k != "panels"}
    errors = [f"dashboard {'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator("Dashboard").iter_errors(top)]
    by_type = {"row": validator("RowPanel")}
    panel_v = validator("Panel")
    checked = 0
    for top_panel in dashboard.get("panels", []):
        nested = top_panel.get("panels", []) if top_panel.get("type") == "row" else []
        for p in [top_panel, *nested]:
            if p is not top_panel and p.get("type") == "row":
                errors.append(f"row {p.get('title')!r} nested in row {top_panel.get('title')!r}")
            v = by_type.get(p.get("type"), panel_v) if p is top_panel else panel_v
            errors += [f"panel {p.get('title')!r} {'/'.join(map(str, e.absolute_path))}: "
                       f"{e.message}" for e in v.iter_errors(p)]
            checked += 1
    assert not errors, "\n".join(errors)
    assert checked == len(list(panels(dashboards()[name])))


@pytest.mark.parametrize("name", EXPECTED_DASHBOARDS)
def test_dashboard_conventions(name):
    d = dashboards()[name]
    assert d.get("uid") == name.removesuffix(".json")
    vars_ = variables(d)
    ds = vars_.get("datasource")
    assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", \
        "a `datasource` template variable of type datasource (prometheus)"
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    for p in panels(d):
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p.get("datasource") == DATASOURCE, p["title"]
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("datasource") == DATASOURCE, (p["title"], t["refId"])
        named = set().union(*(metric_names(t["expr"]) for t in p["targets"]))
        assert named, f"panel {p['title']!r} queries no metric"
        assert p.get("description"), f"panel {p['title']!r} has no description"


@pytest.mark.parametrize("name", EXPECTED_DASHBOARDS)
def test_dashboard_variables_defined(name):
    """Every $variable a query uses is a template variable of the dashboard or a Grafana global."""
    for _, expr in dashboard_exprs(name):
        substitute(expr, dashboards()[name])


@pytest.mark.parametrize("name", EXPECTED_DASHBOARDS)
def test_dashboard_queries_name_only_exported_metrics(name):
    allowed = exported_names()
    bad = {where: sorted(unknown_metrics(expr, allowed)) for where, expr in dashboard_exprs(name)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"metrics the code does not export: {bad}"


def test_slo_thresholds_are_bucket_boundaries():
    """`le="..."` selections (literal or through a variable) match a bucket the code exports."""
    les = histogram_les()
    pattern = re.compile(r'(\w+_bucket)\s*\{[^}]*\ble\s*=\s*"([^"]*)"')
    checked = 0
    for name, d in dashboards().items():
        for where, expr in dashboard_exprs(name):
            for metric, le in pattern.findall(expr):
                var = le.strip("$[]{}")
                values = [o["value"] for o in variables(d)[var]["options"]] if le.startswith("$") \
                    else [le]
                assert values, where
                missing = set(values) - les[metric]
                assert not missing, f"{where}: {metric} has no bucket le in {sorted(missing)}"
                checked += len(values)
    assert checked, "the overview's goodput panels select SLO buckets"


def test_grafana_provisioning():
    ds_files = sorted((GRAFANA / "provisioning" / "datasources").glob("*.y*ml"))
    sources = [s for f in ds_files for s in yaml.safe_load(f.read_text())["datasources"]]
    prom = [s for s in sources if s["type"] == "prometheus"]
    assert prom, "a prometheus datasource is provisioned"
    for d in dashboards().values():
        assert variables(d)["datasource"]["current"]["value"] in {s.get("uid") for s in prom}
    providers = [p for f in sorted((GRAFANA / "provisioning" / "dashboards").glob("*.y*ml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert any(p["type"] == "file" and p["options"]["path"] for p in providers)


# ---------------------------------------------------------------------------
# rules


def test_rule_expressions_name_only_exported_metrics():
    assert rule_files(), "deploy/prometheus/rules/ has rule files"
    allowed = exported_names() | recorded_names() | PROMETHEUS_SYNTHETIC
    bad = {f"{where}: {rule.get('record') or rule.get('alert')}": sorted(unknown)
           for where, rule in all_rules() if (unknown := unknown_metrics(rule["expr"], allowed))}
    assert not bad, f"metrics neither exported nor recorded: {bad}"
    # Recorded names follow level:metric:operations and are recorded from exported metrics.
    for name in recorded_names():
        assert name.count(":") == 2, name


# ---------------------------------------------------------------------------
# PromQL parses


def promtool_or_skip() -> str:
    """promtool's path; skip without it, or fail where REQUIRE_PROMTOOL=1 (.ci/run sets it)."""
    promtool = shutil.which("promtool")
    if not promtool:
        reason = "promtool not installed (Debian: apt-get install -y prometheus)"
        if os.environ.get("REQUIRE_PROMTOOL") == "1":
            pytest.fail(f"REQUIRE_PROMTOOL=1 but {reason}")
        pytest.skip(reason)
    return promtool


def test_promql_parses_with_promtool(tmp_path):
    """Prometheus's own parser: every expression as a recording rule, `promtool check rules`."""
    promtool = promtool_or_skip()
    groups = {}
    for n, (where, expr) in enumerate(parse_cases()):
        groups.setdefault(where, []).append({"record": f"check:expr_{n}:parse", "expr": expr})
    doc = {"groups": [{"name": where, "rules": rules} for where, rules in groups.items()]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promql_parses_with_promql_parser():
    pp = pytest.importorskip("promql_parser", reason="promql-parser (PyPI) not installed")
    errors = []
    for where, expr in parse_cases():
        try:
            pp.parse(expr)
        except ValueError as exc:
            errors.append(f"{where}: {exc}\n  {expr}")
    assert not errors, "\n".join(errors)


def test_parse_checks_reject_bad_promql(tmp_path):
    """The parse checks above would fail on a broken expression."""
    broken = 'sum(rate(tandem_requests_total{status=~"5.."}[5m])'
    promtool = shutil.which("promtool")
    try:
        import promql_parser
    except ImportError:
        promql_parser = None
    if not promtool and promql_parser is None:
        pytest.skip("neither promtool nor promql-parser installed")
    if promtool:
        path = tmp_path / "bad.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
            {"record": "check:bad:parse", "expr": broken}]}]}))
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode != 0
    if promql_parser is not None:
        with pytest.raises(ValueError):
            promql_parser.parse(broken)


def test_goodput_queries_evaluate_as_documented(tmp_path):
    """The overview's goodput queries, run by Prometheus's engine (`promtool test rules`) on
    series where 80 % of TTFTs and 50 % of TPOTs meet the SLOs at 1 request/s: the estimate
    is 1 * 0.8 * 0.5, the bounds max(0, 0.8 + 0.5 - 1) and min(0.8, 0.5)."""
    promtool = promtool_or_skip()
    d = dashboards()["tandem-overview.json"]
    exprs = {t["legendFormat"]: substitute(t["expr"], d) for p in panels(d)
             if p["title"] in ("Goodput against the SLO", "Goodput ratio") for t in p["targets"]}
    ttft, tpot = "tandem_time_to_first_token_seconds", "tandem_time_per_output_token_seconds"
    slo = {v: variables(d)[v]["current"]["value"] for v in ("slo_ttft", "slo_tpot")}
    series = {  # per minute: 60 requests, 48 TTFTs and 30 TPOTs at or under the SLO
        f'{ttft}_bucket{{le="{slo["slo_ttft"]}"}}': "0+48x20", f'{ttft}_bucket{{le="+Inf"}}': "0+60x20",
        f"{ttft}_count": "0+60x20",
        f'{tpot}_bucket{{le="{slo["slo_tpot"]}"}}': "0+30x20", f'{tpot}_bucket{{le="+Inf"}}': "0+60x20",
        f"{tpot}_count": "0+60x20",
        'tandem_requests_total{status="200"}': "0+60x20",
    }
    expected = {"goodput (estimate)": 0.4, "goodput lower bound": 0.3, "goodput upper bound": 0.5,
                "2xx requests": 1.0, "goodput / all": 0.4}
    assert set(expected) <= set(exprs), sorted(exprs)
    doc = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "promql_expr_test": [{"expr": f"round({exprs[name]}, 0.0001)", "eval_time": "10m",
                              "exp_samples": [{"labels": "{}", "value": value}]}
                             for name, value in expected.items()]}]}
    path = tmp_path / "goodput.test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
