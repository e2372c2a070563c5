"""The Helm chart (helm/tandem), rendered and linted by a real Helm engine, offline.

Helm: helm-python-sdk (Helm v4's Go SDK through a C ABI; no helm binary, no
cluster). Every rendered manifest is validated:

- built-in kinds with kubernetes-validate --strict against KUBE_VERSION;
- the RayCluster against the KubeRay CRD in tests/schemas (its
  openAPIV3Schema, int-or-string and nullable mapped to JSON Schema, unknown
  fields rejected where the CRD lists the fields);
- ServiceMonitor/PodMonitor against a structural schema here and, where
  installed, the prometheus-operator models of cloudcoil (generated from its CRDs).

Then the values users depend on are checked in the manifests: replicas, GPUs,
node selectors, the API-key Secret reference, security contexts, selectors
that match, Ray ports that stay private.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

# CI sets REQUIRE_DEPLOY_TOOLS=1: there a missing tool fails instead of skipping.
REQUIRED = os.environ.get("REQUIRE_DEPLOY_TOOLS") == "1"
try:
    import helm_python as helm
except ModuleNotFoundError:
    if REQUIRED:
        raise
    pytest.skip("helm-python-sdk (the Helm v4 SDK) is not installed: pip install helm-python-sdk",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tandem"
CI_DIR = CHART / "ci"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
RAYCLUSTER_CRD = ROOT / "tests" / "schemas" / "kuberay-rayclusters-crd.yaml"

# The Kubernetes version manifests are validated against (and `helm lint --kube-version`).
KUBE_VERSION = "1.33.0"
RELEASE = "tandem"
NAMESPACE = "serving"
RAY_PORTS = {6379, 10001, 8265}
CRD_GROUPS = {"ray.io", "monitoring.coreos.com"}
VALUES_FILES = ("default-values.yaml", "gpu-values.yaml", "all-on-values.yaml", "all-off-values.yaml")


# --------------------------------------------------------------------------- helpers

def load_values(name: str) -> dict[str, Any]:
    """A values file of helm/tandem/ci, parsed by Helm's own YAML reader."""
    return helm.values_from_yaml((CI_DIR / name).read_text()) or {}


@functools.lru_cache(maxsize=None)
def _render_cached(chart_dir: str, values_json: str) -> tuple[tuple[str, str], ...]:
    with helm.Chart.load(chart_dir) as chart:
        out = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    return tuple(sorted(out.items()))


def render_raw(values: dict[str, Any] | None = None, chart_dir: Path = CHART) -> dict[str, str]:
    if chart_dir != CHART:  # a scratch chart that a test changes between renders
        with helm.Chart.load(str(chart_dir)) as chart:
            return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return dict(_render_cached(str(chart_dir), json.dumps(values or {}, sort_keys=True)))


def render(values: dict[str, Any] | None = None, chart_dir: Path = CHART) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders (NOTES.txt left out)."""
    docs = []
    for path, text in render_raw(values, chart_dir).items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                doc = copy.deepcopy(doc)
                doc.setdefault("metadata", {})
                docs.append(doc)
    return docs


def render_file(name: str) -> list[dict[str, Any]]:
    return render(load_values(name))


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in of_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_specs(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(where, pod template metadata, pod spec) of every pod the chart defines."""
    for d in docs:
        if d["kind"] == "Deployment":
            t = d["spec"]["template"]
            yield f"Deployment/{d['metadata']['name']}", t["metadata"], t["spec"]
        elif d["kind"] == "RayCluster":
            t = d["spec"]["headGroupSpec"]["template"]
            yield f"RayCluster/{d['metadata']['name']}/head", t["metadata"], t["spec"]
            for g in d["spec"]["workerGroupSpecs"]:
                t = g["template"]
                yield f"RayCluster/{d['metadata']['name']}/{g['groupName']}", t["metadata"], t["spec"]


def worker_group(rc: dict, name: str) -> dict:
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}, groups.keys()
    return groups[name]


def ray_custom_resources(param: str) -> dict[str, float]:
    """rayStartParams.resources as KubeRay documents it: a JSON object inside a quoted string."""
    assert param.startswith('"') and param.endswith('"'), param
    return json.loads(param[1:-1].replace('\\"', '"'))


def api_key_volume(docs: list[dict]) -> dict:
    """The gateway's API-key Secret volume, after checking the container reads the key from it."""
    spec = one(docs, "Deployment", f"{RELEASE}-gateway")["spec"]["template"]["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "api-key"]
    gw = gateway_container(docs)
    (mount,) = [m for m in gw["volumeMounts"] if m["name"] == "api-key"]
    assert mount["readOnly"] is True
    assert arg_value(gw["args"], "--api-key-file") == f"{mount['mountPath']}/{vol['secret']['items'][0]['path']}"
    return vol["secret"]


def gateway_container(docs: list[dict]) -> dict:
    dep = one(docs, "Deployment", f"{RELEASE}-gateway")
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    return c


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def lint_failures(report: dict[str, Any]) -> list[str]:
    """Lint findings that fail a strict lint (warnings and errors)."""
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + [
        e for e in report["errors"] if not any(e in m["error"] for m in report["messages"])]


# ---------------------------------------------------------------- schema conversions

def crd_to_jsonschema(node: Any, strict: bool = True) -> Any:
    """A CRD's openAPIV3Schema as JSON Schema: int-or-string, nullable, and (strict)
    no fields beyond those the CRD lists, where it lists them (the API server would
    prune unknown fields silently, so a typo would be lost without an error)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: crd_to_jsonschema(sub, strict) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = crd_to_jsonschema(value, strict)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [crd_to_jsonschema(sub, strict) for sub in value]
        elif key == "nullable" or key.startswith("x-kubernetes-"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if (strict and "properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=1)
def raycluster_validator():
    import jsonschema

    assert RAYCLUSTER_CRD.is_file(), f"the KubeRay CRD is missing: {RAYCLUSTER_CRD} (tests/schemas)"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(RAYCLUSTER_CRD.read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = crd_to_jsonschema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def raycluster_errors(doc: dict) -> list[str]:
    assert doc["apiVersion"] == "ray.io/v1"
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in raycluster_validator().iter_errors(doc)]


DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "additionalProperties": False,
             "properties": {"matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}}}
_NS_SELECTOR = {"type": "object", "additionalProperties": False,
                "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}}
_RELABEL = {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
    k: {"type": "string"} for k in ("action", "regex", "replacement", "separator", "targetLabel")} | {
    "modulus": {"type": "integer"}, "sourceLabels": {"type": "array", "items": {"type": "string"}}}}}
_ENDPOINT_COMMON = {
    "port": {"type": "string", "minLength": 1}, "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]}, "interval": {"type": "string", "pattern": DURATION},
    "scrapeTimeout": {"type": "string", "pattern": DURATION}, "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"}, "params": {"type": "object"}, "tlsConfig": {"type": "object"},
    "authorization": {"type": "object"}, "basicAuth": {"type": "object"}, "oauth2": {"type": "object"},
    "relabelings": _RELABEL, "metricRelabelings": _RELABEL, "followRedirects": {"type": "boolean"},
    "enableHttp2": {"type": "boolean"}, "filterRunning": {"type": "boolean"}, "proxyUrl": {"type": "string"},
}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
    "namespace": {"type": "string"}, "labels": _STR_MAP, "annotations": _STR_MAP}, "additionalProperties": False}
# Structural schemas of the two Prometheus Operator kinds the chart uses (monitoring.coreos.com/v1):
# field names and types as in the operator's CRDs, unknown fields rejected.
PROMETHEUS_OPERATOR_SCHEMAS = {
    "ServiceMonitor": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"}, "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"], "properties": {
                "jobLabel": {"type": "string"}, "targetLabels": {"type": "array"}, "podTargetLabels": {"type": "array"},
                "selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR, "sampleLimit": {"type": "integer"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": _ENDPOINT_COMMON | {"targetPort": {"type": ["integer", "string"]},
                                                      "bearerTokenSecret": {"type": "object"}}}},
            }},
        },
    },
    "PodMonitor": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"], "properties": {
                "jobLabel": {"type": "string"}, "podTargetLabels": {"type": "array"},
                "selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR, "sampleLimit": {"type": "integer"},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": _ENDPOINT_COMMON | {"portNumber": {"type": "integer"}}}},
            }},
        },
    },
}


def prometheus_operator_errors(doc: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(PROMETHEUS_OPERATOR_SCHEMAS[doc["kind"]])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def cloudcoil_errors(doc: dict) -> list[str]:
    """Validate with cloudcoil's prometheus-operator models; a field they drop is unknown."""
    from cloudcoil.models.prometheus_operator import v1

    model = getattr(v1, doc["kind"])
    try:
        parsed = model.model_validate(doc)
    except Exception as exc:  # pydantic.ValidationError
        return [str(exc)]
    back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"unknown field {p}" for p in _dropped(doc, back)]


def _dropped(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return [path or "/"]
        return [p for k, v in a.items() for p in (_dropped(v, b[k], f"{path}/{k}") if k in b else [f"{path}/{k}"])]
    if isinstance(a, list):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _dropped(x, y, f"{path}/{i}")]
    return []


def kubernetes_validate_errors(doc: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.absolute_path))}: {exc.message}"]
    return []


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


needs_kubernetes_validate = pytest.mark.skipif(
    not (REQUIRED or _have("kubernetes_validate")),
    reason="kubernetes-validate is not installed: pip install kubernetes-validate")
needs_jsonschema = pytest.mark.skipif(not (REQUIRED or _have("jsonschema")), reason="jsonschema is not installed")


# ------------------------------------------------------------------------------ lint

def test_ci_values_files_are_the_expected_set():
    assert sorted(p.name for p in CI_DIR.glob("*-values.yaml")) == sorted(VALUES_FILES)


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_strict_lint_is_clean(values_file):
    report = helm.lint(str(CHART), load_values(values_file), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["total_charts_linted"] == 1
    assert lint_failures(report) == [], "\n".join(lint_failures(report))


BAD_VALUES = {
    "negative-replicas": ("prefill:\n  replicas: -1\n", ["/prefill/replicas", "minimum"]),
    "negative-gateway-replicas": ("gateway:\n  replicas: -2\n", ["/gateway/replicas", "minimum"]),
    "unknown-top-level-key": ("replicaCount: 3\n", ["additional properties 'replicaCount' not allowed"]),
    "unknown-key-in-worker-group": ("decode:\n  gpu: 1\n", ["/decode", "additional properties 'gpu' not allowed"]),
    "wrong-type": ("decode:\n  gpus: one\n", ["/decode/gpus", "integer"]),
    "ray-port-as-api-port": ("gateway:\n  port: 6379\n", ["/gateway/port"]),
    "unknown-model-source": ("model:\n  source: huggingface\n", ["/model/source"]),
    "pvc-without-claim": ("model:\n  source: pvc\n  name: llama\n", ["/model/pvc", "claimName"]),
    "resources-in-rayStartParams": (
        "prefill:\n  rayStartParams:\n    resources: '{}'\n", ["/prefill/rayStartParams/resources"]),
    "ray-own-resource-as-custom": ("decode:\n  customResources:\n    GPU: 1\n", ["/decode/customResources/GPU"]),
    "unknown-weight-layout": ("prefill:\n  weightLayout: dense\n", ["/prefill/weightLayout"]),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_breaking_the_schema_fail_lint_with_a_clear_message(case, tmp_path):
    text, expected = BAD_VALUES[case]
    values_file = tmp_path / f"{case}.yaml"
    values_file.write_text(text)
    values = helm.values_from_yaml(values_file.read_text())
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    failures = "\n".join(lint_failures(report))
    assert failures, f"{case}: lint passed"
    for fragment in expected:
        assert fragment in failures, f"{case}: {fragment!r} not in lint output:\n{failures}"
    # An install would be refused the same way.
    with pytest.raises(helm.HelmValuesError) as err, helm.Chart.load(str(CHART)) as chart:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert expected[0] in str(err.value)


TEMPLATE_GUARDS = {
    "replicas-outside-autoscaler-bounds": (
        {"ray": {"autoscaling": {"enabled": True}}, "decode": {"replicas": 5, "minReplicas": 1, "maxReplicas": 3}},
        "decode: need minReplicas <= replicas <= maxReplicas"),
    "gpus-with-the-cpu-image": ({"prefill": {"gpus": 1}, "decode": {"gpus": 1}}, "need the CUDA image"),
    "unequal-gpus-per-worker": (
        {"image": {"flavor": "cuda"}, "prefill": {"gpus": 1}, "decode": {"gpus": 2}},
        "tandem serve takes one --gpus-per-worker for both pools"),
    "gpus-not-divisible-by-workers": (
        {"image": {"flavor": "cuda"}, "prefill": {"gpus": 3, "workersPerPod": 2}},
        "prefill.gpus (3) must be a multiple of prefill.workersPerPod (2)"),
    "hpa-min-above-max": (
        {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}}},
        "minReplicas (4) is above maxReplicas (2)"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_GUARDS))
def test_inconsistent_values_fail_rendering_with_a_clear_message(case):
    values, message = TEMPLATE_GUARDS[case]
    with pytest.raises(helm.HelmError) as err, helm.Chart.load(str(CHART)) as chart:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)
    # (Helm 4's lint runs templates in lint mode, where `fail` is only logged:
    # these guards stop install/upgrade/template, the schema ones stop lint too.)


# ------------------------------------------------------------------------ validation

@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_every_manifest_is_a_known_kind(values_file):
    kinds = {(d["apiVersion"], d["kind"]) for d in render_file(values_file)}
    allowed = {("v1", "Service"), ("v1", "ServiceAccount"), ("v1", "Secret"), ("v1", "ConfigMap"),
               ("apps/v1", "Deployment"), ("networking.k8s.io/v1", "Ingress"),
               ("networking.k8s.io/v1", "NetworkPolicy"), ("policy/v1", "PodDisruptionBudget"),
               ("autoscaling/v2", "HorizontalPodAutoscaler"), ("ray.io/v1", "RayCluster"),
               ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}
    assert kinds <= allowed, kinds - allowed


@needs_kubernetes_validate
@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_builtin_kinds_validate_strictly(values_file):
    docs = [d for d in render_file(values_file) if group(d["apiVersion"]) not in CRD_GROUPS]
    assert docs
    errors = {f"{d['kind']}/{d['metadata']['name']}": kubernetes_validate_errors(d) for d in docs}
    assert not any(errors.values()), {k: v for k, v in errors.items() if v}


@needs_jsonschema
@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_raycluster_validates_against_the_kuberay_crd(values_file):
    rc = one(render_file(values_file), "RayCluster")
    errors = raycluster_errors(rc)
    assert errors == [], "\n".join(errors)


@needs_jsonschema
@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_prometheus_operator_resources_are_well_formed(values_file):
    docs = [d for d in render_file(values_file) if group(d["apiVersion"]) == "monitoring.coreos.com"]
    for d in docs:
        assert prometheus_operator_errors(d) == [], d["kind"]


@pytest.mark.skipif(not (REQUIRED or _have("cloudcoil.models.prometheus_operator")),
                    reason="cloudcoil.models.prometheus_operator (models from the operator's CRDs) is not installed")
def test_prometheus_operator_resources_validate_against_the_operator_models():
    docs = [d for d in render_file("all-on-values.yaml") if group(d["apiVersion"]) == "monitoring.coreos.com"]
    assert {d["kind"] for d in docs} == {"ServiceMonitor", "PodMonitor"}
    for d in docs:
        assert cloudcoil_errors(d) == [], d["kind"]


@needs_kubernetes_validate
@needs_jsonschema
def test_the_validators_reject_broken_manifests():
    """The checks above can fail: each validator rejects a broken copy of a rendered manifest."""
    docs = render_file("all-on-values.yaml")
    dep = copy.deepcopy(one(docs, "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonroot"] = True  # typo
    assert kubernetes_validate_errors(dep)
    dep = copy.deepcopy(one(docs, "Deployment"))
    dep["spec"]["replicas"] = "three"
    assert kubernetes_validate_errors(dep)

    rc = one(docs, "RayCluster")
    broken = copy.deepcopy(rc)
    broken["spec"]["workerGroupSpecs"][0]["replica"] = 2  # typo of replicas
    assert any("replica" in e for e in raycluster_errors(broken))
    broken = copy.deepcopy(rc)
    broken["spec"]["workerGroupSpecs"][1]["rayStartParams"]["num-gpus"] = 1  # must be a string
    assert raycluster_errors(broken)
    broken = copy.deepcopy(rc)
    del broken["spec"]["workerGroupSpecs"][0]["groupName"]
    assert raycluster_errors(broken)
    broken = copy.deepcopy(rc)
    broken["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = [1]
    assert raycluster_errors(broken)

    sm = copy.deepcopy(one(docs, "ServiceMonitor"))
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert prometheus_operator_errors(sm)
    pm = copy.deepcopy(one(docs, "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["prot"] = "metrics"
    assert prometheus_operator_errors(pm)
    if REQUIRED or _have("cloudcoil.models.prometheus_operator"):
        assert cloudcoil_errors(sm)
        assert cloudcoil_errors(pm)


# ------------------------------------------------------------------- values that land

def test_defaults_render_a_cpu_cluster_with_one_worker_per_pool():
    docs = render_file("default-values.yaml")
    assert sorted(d["kind"] for d in docs) == ["Deployment", "NetworkPolicy", "NetworkPolicy", "RayCluster",
                                               "Secret", "Secret", "Service", "ServiceAccount"]
    rc = one(docs, "RayCluster")
    assert rc["metadata"]["name"] == RELEASE
    assert rc["spec"]["rayVersion"] == yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["version"]
    assert rc["spec"]["enableInTreeAutoscaling"] is False
    for name in ("prefill", "decode"):
        g = worker_group(rc, name)
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 1)
        assert ray_custom_resources(g["rayStartParams"]["resources"]) == {f"tandem_{name}": 1}
        limits = g["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert "nvidia.com/gpu" not in limits
    images = {c["image"] for _, _, spec in pod_specs(docs) for c in spec["containers"]}
    assert images == {"tandem:0.1.0-cpu"}

    gw = gateway_container(docs)
    args = gw["args"]
    assert args[0] == "serve"
    assert arg_value(args, "--host") == "0.0.0.0" and arg_value(args, "--port") == "8000"
    assert arg_value(args, "--mode") == "disaggregated"
    assert arg_value(args, "--prefill-workers") == "1" and arg_value(args, "--decode-workers") == "1"
    # a full Ray driver on a Ray node of its own (Ray client cannot stream actor results)
    assert arg_value(args, "--ray-address") == f"{RELEASE}-head-svc:6379"
    assert arg_value(args, "--prefill-resource") == "tandem_prefill=1"
    assert arg_value(args, "--decode-resource") == "tandem_decode=1"
    assert "--model" not in args and "--device" not in args  # the embedded model, on CPU
    assert arg_value(args, "--api-key-file") == "/var/run/secrets/tandem/api-key/api-key"
    assert "--allow-unauthenticated" not in args
    assert not {"TANDEM_API_KEY", "RAY_AUTH_TOKEN"} & {e["name"] for e in gw["env"]}  # keys are files
    env = {e["name"]: e.get("value") for e in gw["env"]}
    assert env["TANDEM_CACHE_DIR"].startswith("/home/tandem/")
    probes = {p: gw[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes == {"livenessProbe": "/health", "readinessProbe": "/ready", "startupProbe": "/health"}
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_worker_groups_scale_between_their_bounds_and_drain_before_a_pod_goes():
    """The autoscaling hook: each pool's replicas (what `tandem plan --helm-values`
    writes) and bounds reach KubeRay's autoscaler, and every worker pod drains its
    tandem workers before it is removed (pre-stop `tandem drain --this-node`)."""
    def drain_hook(group: dict) -> tuple[list[str], int]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        return container["lifecycle"]["preStop"]["exec"]["command"], pod["terminationGracePeriodSeconds"]

    # the defaults: no autoscaler, each group fixed at its replicas, the drain hook anyway
    rc = one(render(), "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in rc["spec"]
    for name in ("prefill", "decode"):
        g = worker_group(rc, name)
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 1)
        assert "idleTimeoutSeconds" not in g
        assert drain_hook(g) == (["tandem", "drain", "--this-node", "--ray-address",
                                  f"{RELEASE}-head-svc:6379", "--timeout", "30"], 90)

    # the autoscaler on, with a plan's replicas inside the bounds
    plan = {"ray": {"autoscaling": {"enabled": True}},
            "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
            "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3, "drainTimeoutSeconds": 120}}
    docs = render(plan)
    rc = one(docs, "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    options = rc["spec"]["autoscalerOptions"]
    assert (options["version"], options["upscalingMode"], options["idleTimeoutSeconds"]) == ("v2", "Default", 300)
    for name in ("prefill", "decode"):
        g, want = worker_group(rc, name), plan[name]
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (
            want["replicas"], want["minReplicas"], want["maxReplicas"])
        assert g["idleTimeoutSeconds"] == 300  # an idle pod (its workers drained) goes
    command, grace = drain_hook(worker_group(rc, "decode"))
    assert arg_value(command, "--timeout") == "120" and grace == 180
    # the gateway creates the workers the replicas hold; pending ones make the demand
    args = gateway_container(docs)["args"]
    assert arg_value(args, "--prefill-workers") == "2" and arg_value(args, "--decode-workers") == "1"
    # a drain of 0: running requests are re-driven at once, the pod still waits for it
    rc = one(render({"decode": {"drainTimeoutSeconds": 0}}), "RayCluster")
    command, grace = drain_hook(worker_group(rc, "decode"))
    assert arg_value(command, "--timeout") == "0" and grace == 60


@pytest.mark.parametrize("cpu,num_cpus", [("2", "2"), (3, "3"), ("2.9", "2"), ("1500m", "1"),
                                          ("250m", "1"), ("0.5", "1"), ("2500.5m", "2")])
def test_cpu_pods_advertise_their_cpu_request_as_ray_cpus(cpu, num_cpus):
    """A CPU worker sizes its torch threads on its Ray node (the node's CPUs over the
    workers its pool's resource admits): the pod's CPU request, in whole cores, is that
    count, unless rayStartParams sets it; GPU pods keep KubeRay's and Ray's own."""
    rc = one(render({"prefill": {"resources": {"requests": {"cpu": cpu}}, "workersPerPod": 2},
                     "decode": {"rayStartParams": {"num-cpus": "5"}}}), "RayCluster")
    prefill = worker_group(rc, "prefill")["rayStartParams"]
    assert prefill["num-cpus"] == num_cpus
    assert ray_custom_resources(prefill["resources"]) == {"tandem_prefill": 2}
    assert worker_group(rc, "decode")["rayStartParams"]["num-cpus"] == "5"
    assert one(render(), "RayCluster")["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] == "2"
    gpu = {"image": {"flavor": "cuda"}, "prefill": {"gpus": 1}, "decode": {"gpus": 1}}
    rc = one(render(gpu), "RayCluster")
    assert all("num-cpus" not in worker_group(rc, n)["rayStartParams"] for n in ("prefill", "decode"))


def test_gateway_starts_a_resource_less_ray_node_then_execs_tandem_serve(tmp_path):
    """Run the gateway container's command with stand-ins for `ray` and `tandem`."""
    import subprocess

    gw = gateway_container(render_file("gpu-values.yaml"))
    assert gw["command"][:2] == ["/bin/bash", "-c"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # `ray`: the first health check fails (the head is not up yet), then all succeeds
    (bin_dir / "ray").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/ray.calls\n'
        f'[ "$1" = health-check ] && [ ! -e {tmp_path}/up ] && touch {tmp_path}/up && exit 1\nexit 0\n')
    (bin_dir / "tandem").write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {tmp_path}/tandem.args\n')
    (bin_dir / "sleep").write_text("#!/bin/sh\n")  # no need to wait here
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"} | {
        e["name"]: e["value"] for e in gw["env"] if "value" in e}
    proc = subprocess.run([*gw["command"], *gw["args"]], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    gcs = f"{RELEASE}-head-svc:6379"
    assert (tmp_path / "ray.calls").read_text().splitlines() == [
        f"health-check --address={gcs}", f"health-check --address={gcs}",
        f"start --address={gcs} --num-cpus=0 --num-gpus=0 --object-store-memory=268435456 "
        "--metrics-export-port=8080 --disable-usage-stats"]
    assert f"waiting for the Ray head at {gcs}" in proc.stderr
    assert (tmp_path / "tandem.args").read_text().splitlines() == gw["args"]
    # a failing `ray start` stops the container before tandem runs
    (bin_dir / "ray").write_text('#!/bin/sh\n[ "$1" = start ] && exit 3\nexit 0\n')
    (tmp_path / "tandem.args").unlink()
    proc = subprocess.run([*gw["command"], *gw["args"]], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and not (tmp_path / "tandem.args").exists()


def test_gpu_pools_land_in_the_raycluster_and_the_gateway():
    values = load_values("gpu-values.yaml")
    docs = render(values)
    rc = one(docs, "RayCluster")
    prefill, decode = worker_group(rc, "prefill"), worker_group(rc, "decode")
    assert (prefill["replicas"], decode["replicas"]) == (2, 4)
    for g, gpus in ((prefill, 1), (decode, 2)):
        (c,) = g["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert c["image"] == "registry.example.com/ml/tandem:0.1.0-cuda"
    assert prefill["template"]["spec"]["nodeSelector"] == values["prefill"]["nodeSelector"]
    assert decode["template"]["spec"]["nodeSelector"] == {"node-pool": "gpu-l4"}
    assert prefill["template"]["spec"]["tolerations"] == values["prefill"]["tolerations"]
    assert decode["template"]["spec"]["tolerations"] == values["decode"]["tolerations"]
    assert prefill["template"]["spec"]["affinity"] == values["prefill"]["affinity"]
    assert ray_custom_resources(prefill["rayStartParams"]["resources"]) == {
        "tandem_prefill": 1, "accelerator_type:H100": 1}
    assert ray_custom_resources(decode["rayStartParams"]["resources"]) == {
        "tandem_decode": 2, "accelerator_type:L4": 1, "tandem_long_context": 1}
    assert decode["rayStartParams"]["object-store-memory"] == "4000000000"
    shm = {v["name"]: v for v in decode["template"]["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    # the gateway is not on a GPU pool
    dep = one(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"node-pool": "cpu-general"}
    assert "nvidia.com/gpu" not in json.dumps(dep)

    args = gateway_container(docs)["args"]
    assert arg_value(args, "--prefill-workers") == "2"
    assert arg_value(args, "--decode-workers") == "8"  # 4 pods x 2 workers
    assert arg_value(args, "--device") == "cuda" and arg_value(args, "--gpus-per-worker") == "1"
    assert arg_value(args, "--prefill-accelerator-type") == "H100"
    assert arg_value(args, "--decode-accelerator-type") == "L4"
    assert arg_value(args, "--model") == "/models/Llama-3.1-8B-Instruct"

    # the API key comes from the existing Secret (the chart creates only the Ray token's)
    assert [s["metadata"]["name"] for s in of_kind(docs, "Secret")] == [f"{RELEASE}-ray-auth"]
    assert api_key_volume(docs) == {"secretName": "tandem-api-key", "defaultMode": 0o440,
                                    "items": [{"key": "token", "path": "api-key"}]}
    assert "checksum/api-key" not in json.dumps(one(docs, "Deployment")["spec"]["template"]["metadata"])

    # the model PVC, read-only, in the gateway and every worker
    for where, _, spec in pod_specs(docs):
        if where.endswith("/head"):
            continue
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["model"]["persistentVolumeClaim"] == {"claimName": "llm-weights", "readOnly": True}, where
        (mount,) = [m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models/Llama-3.1-8B-Instruct",
                         "subPath": "hf/Llama-3.1-8B-Instruct", "readOnly": True}, where


@pytest.mark.parametrize("mode,decode_flag", [("disaggregated", "--decode-weight-layout"),
                                              ("colocated", "--cpu-weight-layout")])
def test_each_worker_groups_weight_layout_reaches_tandem_serve(mode, decode_flag):
    args = gateway_container(render({"gateway": {"mode": mode}, "prefill": {"weightLayout": "packed"},
                                     "decode": {"weightLayout": "plain"}}))["args"]
    assert arg_value(args, "--prefill-weight-layout") == "packed"
    assert arg_value(args, decode_flag) == "plain"
    # empty (the default): tandem serve's own defaults
    defaults = gateway_container(render({"gateway": {"mode": mode}}))["args"]
    assert not any(a.endswith("weight-layout") for a in defaults)


def test_everything_on_renders_every_optional_resource_consistently():
    values = load_values("all-on-values.yaml")
    docs = render(values)
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("Ingress", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor", "PodMonitor", "Secret"):
        assert kind in kinds
    assert kinds.count("Secret") == 2  # the API key and the Ray token
    assert kinds.count("PodDisruptionBudget") == 3

    dep = one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert "replicas" not in dep["spec"]  # the HPA owns it
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)

    # the created API-key Secret holds the value and the gateway reads it as a file
    secret = one(docs, "Secret", f"{RELEASE}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == values["apiKey"]["value"]
    assert api_key_volume(docs)["secretName"] == secret["metadata"]["name"]
    assert api_key_volume(docs)["items"] == [{"key": "api-key", "path": "api-key"}]
    assert "checksum/api-key" in dep["spec"]["template"]["metadata"]["annotations"]

    svc = one(docs, "Service")
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 80
    assert selects(svc["spec"]["selector"], pod_labels)
    ing = one(docs, "Ingress")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": svc["metadata"]["name"], "port": {"name": "http"}}
    assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"] == values["gateway"]["ingress"]["tls"]

    # the model image: copied by an init container into every pod that reads it
    for where, _, spec in pod_specs(docs):
        if where.endswith("/head"):
            continue
        (init,) = spec["initContainers"]
        assert init["image"] == "registry.example.com/models/qwen2.5-0.5b:2024-09", where
        assert {e["name"]: e["value"] for e in init["env"]}["MODEL_SRC"] == "/weights"
        assert {v["name"]: v for v in spec["volumes"]}["model"]["emptyDir"] == {"sizeLimit": "20Gi"}

    # PDBs select exactly their pods
    rc = one(docs, "RayCluster")
    pools = {g["groupName"]: g["template"]["metadata"]["labels"] for g in rc["spec"]["workerGroupSpecs"]}
    head_labels = rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    all_pods = {"gateway": pod_labels, "head": head_labels, **pools}
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        chosen = {n for n, labels in all_pods.items() if selects(pdb["spec"]["selector"]["matchLabels"], labels)}
        assert chosen == {pdb["metadata"]["name"].rsplit("-", 1)[1]}, pdb["metadata"]["name"]
    assert one(docs, "PodDisruptionBudget", f"{RELEASE}-decode")["spec"]["maxUnavailable"] == "50%"

    # the Ray autoscaler: bounds from the values, and the head keeps KubeRay's own account
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    assert (worker_group(rc, "decode")["minReplicas"], worker_group(rc, "decode")["maxReplicas"]) == (2, 6)
    assert "serviceAccountName" not in rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "1"  # a value overrides the chart's "0"

    # monitoring: the ServiceMonitor finds the gateway Service and its port; job="tandem"
    sm = one(docs, "ServiceMonitor")
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "tandem"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # the PodMonitor finds every Ray node (head, workers, the gateway's) and their metrics port
    pm = one(docs, "PodMonitor")
    for where, meta, spec in pod_specs(docs):
        assert selects(pm["spec"]["selector"]["matchLabels"], meta["labels"]), where
        ports = {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]}
        assert ports[pm["spec"]["podMetricsEndpoints"][0]["port"]] == 8080, where


def test_everything_off_renders_only_the_core():
    docs = render_file("all-off-values.yaml")
    assert sorted(d["kind"] for d in docs) == ["Deployment", "RayCluster", "Service"]
    rc = one(docs, "RayCluster")
    for name in ("prefill", "decode"):
        assert worker_group(rc, name)["replicas"] == 0
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 0
    args = gateway_container(docs)["args"]
    assert arg_value(args, "--prefill-workers") == "0" and arg_value(args, "--model") == "/models/tinyllama"
    for where, _, spec in pod_specs(docs):
        assert spec["serviceAccountName"] == "default", where
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["tmp"]["emptyDir"] == {} and vols["home"]["emptyDir"] == {}, where
        if not where.endswith("/head"):
            assert vols["model"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}, where
    gw = gateway_container(docs)
    assert "TANDEM_API_KEY" not in {e["name"] for e in gw["env"]}
    assert "--allow-unauthenticated" in gw["args"] and "--api-key-file" not in gw["args"]
    assert "RAY_AUTH_MODE" not in json.dumps(docs)


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_security_contexts(values_file):
    docs = render_file(values_file)
    specs = list(pod_specs(docs))
    assert len(specs) == 4  # gateway, head, prefill, decode
    autoscaler = one(docs, "RayCluster")["spec"]["enableInTreeAutoscaling"]
    for where, _, spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True, where
        if not (where.endswith("/head") and autoscaler):
            assert spec["automountServiceAccountToken"] is False, where
        mounts_needed = {"/tmp", "/home/tandem"}
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert "ALL" in sc["capabilities"]["drop"], (where, c["name"])
            assert sc.get("privileged") is not True, (where, c["name"])
            assert sc["runAsNonRoot"] is True, (where, c["name"])
        for c in spec["containers"]:
            mounted = {m["mountPath"] for m in c["volumeMounts"]}
            assert mounts_needed <= mounted, (where, c["name"], mounted)
        scratch = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        assert {"tmp", "home"} <= scratch, where
    rc = one(docs, "RayCluster")
    if autoscaler:
        assert rc["spec"]["autoscalerOptions"]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_ray_ports_stay_inside_the_cluster(values_file):
    docs = render_file(values_file)
    rc = one(docs, "RayCluster")
    assert rc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert not rc["spec"]["headGroupSpec"].get("enableIngress")
    for svc in of_kind(docs, "Service"):
        exposed = {p["port"] for p in svc["spec"]["ports"]} | {p.get("targetPort") for p in svc["spec"]["ports"]}
        assert not (exposed & RAY_PORTS), svc["metadata"]["name"]
    for ing in of_kind(docs, "Ingress"):
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] == f"{RELEASE}-gateway"
    head_ports = {p["containerPort"] for p in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert RAY_PORTS <= head_ports


def test_network_policies_keep_ray_traffic_among_ray_nodes():
    values = load_values("all-on-values.yaml")
    docs = render(values)
    policies = {p["metadata"]["name"]: p for p in of_kind(docs, "NetworkPolicy")}
    assert set(policies) == {f"{RELEASE}-ray", f"{RELEASE}-gateway-api"}
    pods = {w: m["labels"] for w, m, _ in pod_specs(docs)}
    gateway = f"Deployment/{RELEASE}-gateway"
    assert len(pods) == 4

    ray = policies[f"{RELEASE}-ray"]["spec"]
    # every Ray node is covered: head, workers, and the gateway (a Ray node of its own)
    assert all(selects(ray["podSelector"]["matchLabels"], labels) for labels in pods.values())
    assert ray["policyTypes"] == ["Ingress"]
    rules = ray["ingress"]
    assert all(r.get("from") for r in rules), "no rule may admit everyone"
    # 1: Ray nodes among themselves, every port
    peer = rules[0]["from"][0]["podSelector"]["matchLabels"]
    assert "ports" not in rules[0] and all(selects(peer, labels) for labels in pods.values())
    assert set(rules[0]["from"][0]) == {"podSelector"}  # this namespace only
    # 2: metrics scrapers on 8080 only; 3: the extra rule from the values
    assert rules[1] == {"from": values["networkPolicy"]["metricsFrom"], "ports": [{"port": 8080, "protocol": "TCP"}]}
    assert rules[2:] == values["networkPolicy"]["extraIngress"]

    api = policies[f"{RELEASE}-gateway-api"]["spec"]
    chosen = {w for w, labels in pods.items() if selects(api["podSelector"]["matchLabels"], labels)}
    assert chosen == {gateway}
    (rule,) = api["ingress"]
    assert rule == {"ports": [{"port": "http", "protocol": "TCP"}], "from": values["networkPolicy"]["apiFrom"]}
    http = {p["name"]: p["containerPort"] for p in gateway_container(docs)["ports"]}["http"]
    assert http not in RAY_PORTS

    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    docs = render(values | {"networkPolicy": values["networkPolicy"] | {"apiFrom": peers}})
    api = one(docs, "NetworkPolicy", f"{RELEASE}-gateway-api")["spec"]
    assert api["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}], "from": peers}]


def test_dashboard_configmaps_from_zero_or_more_files(tmp_path):
    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart, symlinks=False, ignore=shutil.ignore_patterns("*.json"))
    on = {"monitoring": {"dashboards": {"enabled": True}}}
    # zero dashboards: nothing, and no error
    assert not of_kind(render(on, chart), "ConfigMap")
    dashboards = {"tandem-overview.json": {"title": "Overview", "panels": [], "uid": "o"},
                  "Pools View.json": {"title": "Pools", "panels": [{"type": "text"}], "uid": "p"}}
    for name, body in dashboards.items():
        (chart / "dashboards" / name).write_text(json.dumps(body, indent=1) + "\n")
    cms = {cm["metadata"]["name"]: cm for cm in of_kind(render(on, chart), "ConfigMap")}
    assert set(cms) == {f"{RELEASE}-dashboard-tandem-overview", f"{RELEASE}-dashboard-pools-view"}
    for cm in cms.values():
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "tandem"
        ((key, text),) = cm["data"].items()
        assert key.endswith(".json")
        assert json.loads(text) in dashboards.values()
    assert json.loads(cms[f"{RELEASE}-dashboard-pools-view"]["data"]["pools-view.json"]) == dashboards["Pools View.json"]
    # off: none, whatever the folder holds
    assert not of_kind(render({}, chart), "ConfigMap")


def _grafana_dashboards() -> dict[str, Path]:
    return {p.name: p.resolve() for p in sorted(GRAFANA_DIR.rglob("*.json"))} if GRAFANA_DIR.is_dir() else {}


def test_chart_links_every_dashboard_of_deploy_grafana():
    links = {p.name: p for p in (CHART / "dashboards").iterdir() if p.suffix == ".json"}
    fix = "run helm/link-dashboards.sh (see helm/tandem/dashboards/README.md)"
    for name, link in links.items():
        assert link.is_symlink(), f"dashboards/{name} is a copy, not a link to deploy/grafana: {fix}"
        assert not os.path.isabs(os.readlink(link)), f"dashboards/{name}: the link must be relative"
        assert link.exists(), f"dashboards/{name} points nowhere (Helm refuses to load the chart): {fix}"
        assert GRAFANA_DIR.resolve() in link.resolve().parents, f"dashboards/{name} points outside deploy/grafana"
    expected = _grafana_dashboards()
    assert {n: p.resolve() for n, p in links.items()} == expected, fix
    if expected:
        cms = of_kind(render({"monitoring": {"dashboards": {"enabled": True}}}), "ConfigMap")
        assert len(cms) == len(expected)
        rendered = {json.dumps(json.loads(t), sort_keys=True) for cm in cms for t in cm["data"].values()}
        assert rendered == {json.dumps(json.loads(p.read_text()), sort_keys=True) for p in expected.values()}


def test_package_resolves_links_and_leaves_ci_values_out(tmp_path):
    import tarfile

    archive = helm.package(str(CHART), destination=str(tmp_path))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert not any(n.startswith("tandem/ci/") for n in names)
        for name in _grafana_dashboards():
            member = tar.getmember(f"tandem/dashboards/{name}")
            assert member.isfile()  # contents, not a link
    with helm.Chart.load(archive) as chart:
        out = chart.render({}, name=RELEASE, namespace=NAMESPACE)
    assert {k.replace("tandem/templates/", "") for k in out} >= {"raycluster.yaml", "gateway-deployment.yaml"}


def test_notes_say_how_to_reach_the_api():
    notes = render_raw({})["tandem/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-gateway 8000:8000" in notes
    assert "/v1/chat/completions" in notes and "WARNING" not in notes  # closed by default
    assert f"get secret {RELEASE}-api-key" in notes and "Authorization: Bearer $TANDEM_API_KEY" in notes
    notes = render_raw(load_values("all-on-values.yaml"))["tandem/templates/NOTES.txt"]
    assert "export TANDEM_URL=https://llm.example.com" in notes
    assert f"get secret {RELEASE}-api-key" in notes and "Authorization: Bearer $TANDEM_API_KEY" in notes
    assert "WARNING" not in notes


# ------------------------------------------------------------------- values contract

def _keys(tree: Any) -> Any:
    return {k: _keys(v) for k, v in tree.items()} if isinstance(tree, dict) else None


def test_prefill_and_decode_blocks_have_the_same_shape():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _keys(values["prefill"]) == _keys(values["decode"])
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["prefill"] == schema["properties"]["decode"] == {"$ref": "#/$defs/workerGroup"}


def test_default_values_satisfy_the_schema_and_every_key_is_documented():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft202012Validator(schema).validate(values)
    # every setting (a key of the chart's own, schema-closed objects whose value is
    # not itself such an object) has a comment right above it
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w.-]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        stack.append((indent, key))
        if _own_key(schema, path) and not lines[i - 1].lstrip().startswith("#"):
            undocumented.append(".".join(path))
    assert undocumented == [], f"values.yaml keys without a comment above: {undocumented}"


# Values that are Kubernetes objects (ResourceRequirements, DeploymentStrategy):
# documented as a whole, their fields are Kubernetes'.
KUBERNETES_OBJECTS = {"resources", "strategy"}


def _own_key(schema: dict, path: list[str]) -> bool:
    """Whether path names a property of one of the chart's own objects (not a Kubernetes passthrough map)."""
    if any(k in KUBERNETES_OBJECTS for k in path[:-1]):
        return False
    node = schema
    for key in path[:-1]:
        node = _deref(schema, node)
        if node.get("additionalProperties") is not False:
            return False
        node = node["properties"][key]
    node = _deref(schema, node)
    if node.get("additionalProperties") is not False or path[-1] not in node.get("properties", {}):
        return False
    leaf = _deref(schema, node["properties"][path[-1]])
    return not (isinstance(leaf, dict) and leaf.get("additionalProperties") is False and "properties" in leaf)


def _deref(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


# ------------------------------------------------------------------- secure by default

def ray_containers(docs: list[dict]) -> Iterator[tuple[str, dict, dict]]:
    """(where, container, pod spec) of every container that runs a Ray process."""
    for where, _, spec in pod_specs(docs):
        for c in spec["containers"]:
            yield f"{where}/{c['name']}", c, spec
    rc = one(docs, "RayCluster")
    if rc["spec"]["enableInTreeAutoscaling"]:
        yield "autoscaler", rc["spec"]["autoscalerOptions"], rc["spec"]["headGroupSpec"]["template"]["spec"]


@pytest.mark.parametrize("values_file", ["default-values.yaml", "gpu-values.yaml", "all-on-values.yaml"])
def test_every_ray_process_requires_the_ray_token_from_a_mounted_secret(values_file):
    docs = render_file(values_file)
    secret = one(docs, "Secret", f"{RELEASE}-ray-auth")
    assert set(secret["data"]) == {"token"} and len(base64.b64decode(secret["data"]["token"])) >= 32
    checked = 0
    for where, c, spec in ray_containers(docs):
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", where
        assert "RAY_AUTH_TOKEN" not in env, where  # a file, never an environment variable
        path = env["RAY_AUTH_TOKEN_PATH"]["value"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "ray-auth"]
        assert path == f"{mount['mountPath']}/token" and mount["readOnly"] is True, where
        (vol,) = [v for v in spec["volumes"] if v["name"] == "ray-auth"]
        assert vol["secret"]["secretName"] == secret["metadata"]["name"], where
        assert vol["secret"]["items"] == [{"key": "token", "path": "token"}], where
        assert vol["secret"]["defaultMode"] & 0o007 == 0, where  # not world-readable
        checked += 1
    assert checked == (5 if values_file == "all-on-values.yaml" else 4)


def test_the_dashboard_is_on_loopback_unless_asked_for():
    rc = one(render_file("default-values.yaml"), "RayCluster")
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    (c,) = head["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):  # the kubelet cannot reach loopback: probe inside
        cmd = c[probe]["exec"]["command"]
        assert cmd[:2] == ["python", "-c"] and "http://127.0.0.1:8265/api/gcs_healthz" in cmd[2]
    assert "POD_IP" not in {e["name"] for e in c["env"]}

    rc = one(render_file("all-on-values.yaml"), "RayCluster")
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "$(POD_IP)"  # expanded by Kubernetes in args
    (c,) = head["template"]["spec"]["containers"]
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["readinessProbe"]["httpGet"] == {"path": "/api/gcs_healthz", "port": 8265}
    assert "0.0.0.0" not in json.dumps(rc)


def test_the_dashboard_host_is_not_a_raystartparam(tmp_path):
    values = {"ray": {"head": {"rayStartParams": {"dashboard-host": "0.0.0.0"}}}}
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert "/ray/head/rayStartParams/dashboard-host" in "\n".join(lint_failures(report))


OPENINGS = {
    "networkPolicy": ({"networkPolicy": {"enabled": False}}, "networkPolicy.enabled=false"),
    "ray-auth": ({"ray": {"auth": {"enabled": False}}}, "ray.auth.enabled=false"),
    "api-key": ({"apiKey": {"enabled": False}}, "apiKey.enabled=false"),
}


@pytest.mark.parametrize("case", sorted(OPENINGS))
def test_turning_a_defence_off_needs_an_explicit_flag_and_warns(case):
    values, flag = OPENINGS[case]
    with pytest.raises(helm.HelmError) as err, helm.Chart.load(str(CHART)) as chart:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert flag in str(err.value) and "security.allowInsecure=true" in str(err.value)

    allowed = values | {"security": {"allowInsecure": True}}
    notes = render_raw(allowed)["tandem/templates/NOTES.txt"]
    assert f"WARNING: {flag}" in notes
    assert notes.count("WARNING") == 1
    docs = render(allowed)
    if case == "networkPolicy":
        assert not of_kind(docs, "NetworkPolicy")
    elif case == "ray-auth":
        assert "RAY_AUTH_MODE" not in json.dumps(docs) and not of_kind(docs, "Secret")[1:]
        assert [s["metadata"]["name"] for s in of_kind(docs, "Secret")] == [f"{RELEASE}-api-key"]
    else:
        args = gateway_container(docs)["args"]
        assert "--allow-unauthenticated" in args and "--api-key-file" not in args
        assert [s["metadata"]["name"] for s in of_kind(docs, "Secret")] == [f"{RELEASE}-ray-auth"]


@pytest.mark.parametrize("gateway", [{"ingress": {"enabled": True}}, {"service": {"type": "LoadBalancer"}},
                                     {"service": {"type": "NodePort"}}])
def test_a_public_entry_point_needs_networkpolicy_apifrom(gateway):
    with pytest.raises(helm.HelmError) as err, helm.Chart.load(str(CHART)) as chart:
        chart.render({"gateway": gateway}, name=RELEASE, namespace=NAMESPACE)
    assert "name who may reach it" in str(err.value)
    peers = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    api = one(render({"gateway": gateway, "networkPolicy": {"apiFrom": peers}}), "NetworkPolicy",
              f"{RELEASE}-gateway-api")
    assert api["spec"]["ingress"][0]["from"] == peers


def test_default_network_policies_select_exactly_the_pods_they_protect():
    docs = render_file("default-values.yaml")
    pods = {where: meta["labels"] for where, meta, _ in pod_specs(docs)}
    assert len(pods) == 4
    gateway = f"Deployment/{RELEASE}-gateway"
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}

    ray = policies[f"{RELEASE}-ray"]
    assert {w for w, labels in pods.items() if selects(ray["podSelector"]["matchLabels"], labels)} == set(pods)
    (rule,) = ray["ingress"]  # nothing but the release's Ray nodes, on any port
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"} and "ports" not in rule
    assert {w for w, labels in pods.items() if selects(peer["podSelector"]["matchLabels"], labels)} == set(pods)
    # a pod of another release (same chart, other instance) is not a peer
    other = dict(pods[gateway]) | {"app.kubernetes.io/instance": "other"}
    assert not selects(peer["podSelector"]["matchLabels"], other)

    api = policies[f"{RELEASE}-gateway-api"]
    assert {w for w, labels in pods.items() if selects(api["podSelector"]["matchLabels"], labels)} == {gateway}
    (rule,) = api["ingress"]
    assert rule == {"ports": [{"port": "http", "protocol": "TCP"}], "from": [{"podSelector": {}}]}  # this namespace
    http = {p["name"] for p in gateway_container(docs)["ports"]}
    assert "http" in http


def _secret_values(docs: list[dict]) -> set[str]:
    values = set()
    for s in of_kind(docs, "Secret"):
        for encoded in s.get("data", {}).values():
            values |= {encoded, base64.b64decode(encoded).decode()}
        values |= set(s.get("stringData", {}).values())
    return values


@pytest.mark.parametrize("values", [{}, load_values("all-on-values.yaml"), load_values("gpu-values.yaml")],
                         ids=["defaults", "all-on", "gpu"])
def test_no_secret_value_appears_outside_a_secret(values):
    raw = render_raw(values)
    docs = render(values)
    secrets = _secret_values(docs)
    assert secrets
    if values.get("apiKey", {}).get("value"):
        assert values["apiKey"]["value"] in secrets
    elsewhere = [text for path, text in raw.items() if not path.endswith("/secret.yaml")]
    for secret in secrets:
        for text in elsewhere:
            assert secret not in text


def test_the_api_key_checksum_is_salted_by_a_salt_kept_in_the_secret():
    import hashlib

    values = load_values("all-on-values.yaml")
    docs = render(values)
    secret = one(docs, "Secret", f"{RELEASE}-api-key")
    annotation = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/api-key"]
    key_b64 = secret["data"]["api-key"]
    assert annotation != hashlib.sha256(values["apiKey"]["value"].encode()).hexdigest()  # not guessable
    assert annotation == hashlib.sha256(f"{secret['data']['checksum-salt']}:{key_b64}".encode()).hexdigest()
    assert len(base64.b64decode(secret["data"]["checksum-salt"])) >= 32
    # the generated key (no value given): a fresh random one per install, 48 characters
    generated = one(render_file("default-values.yaml"), "Secret", f"{RELEASE}-api-key")
    key = base64.b64decode(generated["data"]["api-key"]).decode()
    assert len(key) == 48 and key.isalnum()


def test_metrics_behind_the_api_key_on_request():
    values = load_values("all-on-values.yaml") | {"gateway": load_values("all-on-values.yaml")["gateway"]
                                                  | {"metricsRequireKey": True}}
    docs = render(values)
    assert "--metrics-require-key" in gateway_container(docs)["args"]
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": f"{RELEASE}-api-key", "key": "api-key"}}
    assert prometheus_operator_errors(sm) == []
    if REQUIRED or _have("cloudcoil.models.prometheus_operator"):
        assert cloudcoil_errors(sm) == []
    assert "--metrics-require-key" not in gateway_container(render_file("all-on-values.yaml"))["args"]
    with pytest.raises(helm.HelmError) as err, helm.Chart.load(str(CHART)) as chart:
        chart.render({"gateway": {"metricsRequireKey": True}, "apiKey": {"enabled": False},
                      "security": {"allowInsecure": True}}, name=RELEASE, namespace=NAMESPACE)
    assert "gateway.metricsRequireKey needs apiKey.enabled" in str(err.value)
