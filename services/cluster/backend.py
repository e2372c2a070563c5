"""The cluster as the gateway's ``Backend``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.cluster.cluster import Cluster
from services.common.metrics import cluster_families
from services.common.sampling_params import SamplingParams
from services.protocol.request_path import TokenDelta


class ClusterBackend:
    """Adapts ``Cluster`` to ``services.gateway.backend.Backend``."""

    def __init__(self, cluster: Cluster, model_id: str, max_model_len: int, vocab_size: int) -> None:
        self.cluster = cluster
        self.model_id, self.max_model_len, self.vocab_size = model_id, max_model_len, vocab_size

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenDelta]:
        return self.cluster.generate(prompt_token_ids, params, request_id)

    async def ready(self) -> bool:
        """Every pool has a live worker and the transfer group is not being rebuilt."""
        c = self.cluster
        if c.driver is None or not c.serving:
            return False
        await c.refresh_loads()
        pools = [c.decode] + ([c.prefill] if c.prefill else [])
        return all(any(w.load().alive for w in pool) for pool in pools)

    async def metric_families(self) -> list:
        """The workers' families plus the cluster's own counts (served by the gateway)."""
        c = self.cluster
        ready: dict[str, int] = {}
        for w in c.prefill + c.decode:
            ready[w.role] = ready.get(w.role, 0) + int(w.load().alive)
        own = cluster_families(c.router.decisions, c.driver.num_redrives, c.replacements, ready)
        return own + await c.worker_metric_families()
