"""The cluster as the gateway's ``Backend``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from tandem.cluster.cluster import Cluster
from tandem.cluster.placement import placement_family
from tandem.cluster.telemetry import DEFAULT_INTERVAL_S, ClusterTelemetry
from tandem.common.metrics import cluster_families
from tandem.common.sampling_params import SamplingParams
from tandem.protocol.request_path import TokenDelta


class ClusterBackend:
    """Adapts ``Cluster`` to ``tandem.gateway.backend.Backend``."""

    def __init__(self, cluster: Cluster, model_id: str, max_model_len: int, vocab_size: int,
                 telemetry_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.cluster = cluster
        self.telemetry = ClusterTelemetry(cluster, telemetry_interval_s)
        self.model_id, self.max_model_len, self.vocab_size = model_id, max_model_len, vocab_size

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenDelta]:
        return self.cluster.generate(prompt_token_ids, params, request_id)

    async def ready(self) -> bool:
        """Every pool has a live worker (as of the last refresh) and the transfer group is
        not being rebuilt. Reads the telemetry snapshot: no call to the workers."""
        c = self.cluster
        if c.driver is None or not c.serving:
            return False
        return (await self.telemetry.snapshot()).ready

    async def metric_families(self) -> list:
        """The workers' families (as of the last refresh) plus the cluster's own counts."""
        c = self.cluster
        snap = await self.telemetry.snapshot()
        ready: dict[str, int] = {}
        for w in c.prefill + c.decode:
            ready[w.role] = ready.get(w.role, 0) + int(w.load().alive)
        own = cluster_families(c.router.decisions, c.driver.num_redrives, c.replacements, ready)
        own.append(placement_family(c.prefill + c.decode, c.placement))
        own += c.migrations.registry.collect()
        return own + snap.worker_families
