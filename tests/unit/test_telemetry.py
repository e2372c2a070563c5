"""/ready and /metrics read a snapshot the cluster refreshes itself: probes and scrapes never
call the workers; /metrics can be put behind the API key."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from tandem.cluster.backend import ClusterBackend
from tandem.cluster.telemetry import ClusterTelemetry
from tandem.gateway import create_app
from tests.fake_backend import FakeBackend
from tandem.router.load import WorkerLoad
from tandem.text.tokenizer import Tokenizer

KEY = "sk-metrics-key-0123"


@pytest.fixture
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


class FakeWorker:
    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id, self.role, self.alive = worker_id, role, True

    def load(self) -> WorkerLoad:  # what the cluster's refresher keeps current
        return WorkerLoad(self.worker_id, self.role, alive=self.alive)


class FakeCluster:
    """The parts of ``Cluster`` the backend reads; counts every call to the workers."""

    def __init__(self) -> None:
        self.prefill = [FakeWorker("p0", "prefill")]
        self.decode = [FakeWorker("d0", "decode"), FakeWorker("d1", "decode")]
        self.driver = SimpleNamespace(num_redrives=0)
        self.router = SimpleNamespace(decisions={})
        self.migrations = SimpleNamespace(registry=CollectorRegistry())
        self.replacements = 0
        self.placement: dict = {}  # worker id -> NodePlacement
        self.serving = True
        self.worker_calls = 0

    async def worker_metric_families(self) -> list:
        fams = []
        for w in self.prefill + self.decode:
            self.worker_calls += 1
            g = GaugeMetricFamily("tandem_fake_worker_up", "fake", labels=["worker"])
            g.add_metric([w.worker_id], float(w.alive))
            fams.append(g)
        return fams


def _app(cluster: FakeCluster, tok: Tokenizer, interval_s: float):
    backend = ClusterBackend(cluster, "fake", 128, tok.vocab_size, telemetry_interval_s=interval_s)
    return create_app(backend, tok), backend


def test_probes_and_scrapes_never_call_the_workers(tok):
    cluster = FakeCluster()
    app, backend = _app(cluster, tok, interval_s=3600)  # one refresh in this test
    with TestClient(app) as c:
        for _ in range(40):
            assert c.get("/ready").status_code == 200
            r = c.get("/metrics")
            assert r.status_code == 200 and 'tandem_fake_worker_up{worker="d1"} 1.0' in r.text
    assert backend.telemetry.refreshes == 1
    assert cluster.worker_calls == 3  # one metrics call per worker, once


def test_readiness_follows_the_refreshed_snapshot(tok):
    cluster = FakeCluster()
    app, backend = _app(cluster, tok, interval_s=0.01)
    with TestClient(app) as c:
        assert c.get("/ready").status_code == 200
        cluster.prefill[0].alive = False  # the only prefill worker dies
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready never noticed the dead pool"
            time.sleep(0.01)
        assert 'tandem_fake_worker_up{worker="p0"} 0.0' in c.get("/metrics").text
        cluster.serving = False  # a rebuild under way: not ready whatever the snapshot says
        cluster.prefill[0].alive = True
        assert c.get("/ready").status_code == 503


def test_a_stale_snapshot_reads_as_not_ready():
    cluster = FakeCluster()
    telemetry = ClusterTelemetry(cluster, interval_s=3600, max_age_s=-1)  # always too old

    async def take():
        try:
            return await telemetry.snapshot()
        finally:
            telemetry.close()

    snap = asyncio.run(take())
    assert snap.ready is False and len(snap.worker_families) == 3
    with pytest.raises(ValueError):
        ClusterTelemetry(cluster, interval_s=0)


def test_metrics_behind_the_api_key_on_request(tok):
    fake = FakeBackend(vocab_size=tok.vocab_size)
    with TestClient(create_app(fake, tok, api_keys=[KEY])) as c:
        assert c.get("/metrics").status_code == 200  # open by default, like the probes
    with TestClient(create_app(fake, tok, api_keys=[KEY], metrics_require_key=True)) as c:
        r = c.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
    with pytest.raises(ValueError, match="metrics_require_key needs api_keys"):
        create_app(fake, tok, metrics_require_key=True)
