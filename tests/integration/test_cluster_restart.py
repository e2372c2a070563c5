"""Workers outlive their gateway: with a deployment name they are detached actors; a
gateway process that dies (hard exit) leaves them running, and the next one re-attaches
to them (same processes, no model reload), serves exactly, and out-ranks the old one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import ray

from tests.integration.test_cluster import _config, prompts, reference, run_all  # noqa: F401

_GATEWAY = """
import json, os, sys, ray
from tandem.cluster.cluster import Cluster
from tests.integration.test_cluster import _config
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
c = Cluster(_config(sys.argv[2], prefill_workers=1, decode_workers=2), deployment="restart").start()
print(json.dumps({w.worker_id: ray.get(w.actor.pid.remote()) for w in c.prefill + c.decode}),
      flush=True)
os._exit(0)  # the gateway dies without shutting anything down
"""


def _pids(cluster) -> dict[str, int]:
    return {w.worker_id: ray.get(w.actor.pid.remote()) for w in cluster.prefill + cluster.decode}


def test_a_restarted_gateway_reattaches_to_the_workers_of_a_dead_one(ray_session, checkpoint,
                                                                     prompts, reference):
    from tandem.cluster.attach import find, worker_identity
    from tandem.cluster.cluster import Cluster

    address = ray.get_runtime_context().gcs_address
    out = subprocess.run([sys.executable, "-c", _GATEWAY, address, checkpoint],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    before = json.loads(out.stdout.strip().splitlines()[-1])
    config = _config(checkpoint, prefill_workers=1, decode_workers=2)
    cluster = Cluster(config, deployment="restart").start()
    try:
        assert cluster.reattached == ["decode-0", "decode-1", "prefill-0"]
        assert _pids(cluster) == before  # the same processes: no model was reloaded
        assert run_all(cluster, prompts) == reference
        # the dead gateway's generation can no longer claim them
        actor = cluster.decode[0].actor
        assert ray.get(actor.claim.remote(1, worker_identity(cluster, "decode-0"))) == "stale"
        cluster.shutdown()  # a deployment's workers stay
        assert find("restart", "decode-0") is not None
        # another configuration does not re-attach: its workers are replaced
        other = Cluster(dataclasses.replace(config, transfer_timeout_s=7.0),
                        deployment="restart").start()
        try:
            assert other.reattached == []
            assert set(_pids(other).values()).isdisjoint(before.values())
            assert asyncio.run(other.worker_stats())[0]["alive"]
        finally:
            other.shutdown(kill_workers=True)
    finally:
        cluster.shutdown(kill_workers=True)
