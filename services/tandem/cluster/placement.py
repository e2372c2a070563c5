"""Where each worker runs: the Ray node (id and address) that hosts its actor.

Asked once per actor (after it is up, and again for a replacement), by running a small
function on the actor itself (Ray's ``__ray_call__``), so it needs neither the Ray
dashboard nor the state API. The gateway logs the placement at start-up and exports it
as ``tandem_worker_node_info{role, worker, node_id, node_ip} 1``: on a multi-node
cluster, which prefill and decode workers share a node (and a network link) shows there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ray
from prometheus_client.core import GaugeMetricFamily

from tandem.common.metrics import PREFIX


@dataclass(frozen=True)
class NodePlacement:
    """The Ray node a worker's actor runs on."""

    node_id: str  # hex, as ray.get_runtime_context().get_node_id()
    node_ip: str

    def short(self) -> str:
        return f"node {self.node_id[:8]} ({self.node_ip})"


def _where(_actor_instance: object) -> tuple[str, str]:
    """Runs inside the actor: its node's id and address."""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def locate(workers: Sequence, timeout_s: float) -> dict[str, NodePlacement]:
    """``{worker_id: NodePlacement}`` of live workers (those that do not answer are left out)."""
    refs = [(w.worker_id, w.actor.__ray_call__.remote(_where)) for w in workers]
    found: dict[str, NodePlacement] = {}
    for wid, ref in refs:
        try:
            found[wid] = NodePlacement(*ray.get(ref, timeout=timeout_s))
        except Exception:  # noqa: BLE001 - a dead worker has no placement; it is replaced
            continue
    return found


def describe(workers: Sequence, placement: dict[str, NodePlacement]) -> str:
    """One line for the operator: each worker and its node."""
    return ", ".join(f"{w.worker_id} on {placement[w.worker_id].short()}"
                     for w in workers if w.worker_id in placement)


def placement_family(workers: Sequence, placement: dict[str, NodePlacement]) -> GaugeMetricFamily:
    """``tandem_worker_node_info``: 1 per worker, labelled with its node."""
    family = GaugeMetricFamily(f"{PREFIX}worker_node_info",
                               "The Ray node that hosts each worker (always 1)",
                               labels=("role", "worker", "node_id", "node_ip"))
    for w in workers:
        p = placement.get(w.worker_id)
        if p is not None:
            family.add_metric((str(w.role), w.worker_id, p.node_id, p.node_ip), 1)
    return family
