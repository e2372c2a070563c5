"""``tandem drain``: take workers out of a running cluster without cutting a stream.

Named workers (``decode-1``), or every worker on a Ray node (``--node ID``, or
``--this-node``: what a worker pod's pre-stop hook runs before Kubernetes removes it).
The request goes to the gateway through the Ray cluster (see ``control``); the command
waits for the outcome and exits 0 when every worker drained, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from services.cluster.drain import DRAIN_TIMEOUT_S

ANSWER_MARGIN_S = 60.0  # beyond the drain timeout: exiting the actor, a group rebuild


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workers", nargs="*", metavar="WORKER",
                   help="worker ids to drain, e.g. decode-1 (see tandem_worker_node_info)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--node", metavar="NODE_ID", help="drain every worker on this Ray node")
    where.add_argument("--this-node", action="store_true",
                       help="drain every worker on the Ray node this command runs on "
                       "(a worker pod's pre-stop hook); nothing there: exit 0 at once")
    p.add_argument("--ray-address", default="auto",
                   help="the Ray cluster of the gateway (default: the one on this machine)")
    p.add_argument("--deployment", default=None,
                   help="the gateway's --deployment, when several gateways share the cluster")
    p.add_argument("--timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="let running requests finish for up to S seconds; those still "
                   "running then are re-driven on other workers")


def main(args: argparse.Namespace) -> int:
    import ray

    from services.cluster import control
    from services.cluster.ray_start import RayRuntime

    if bool(args.workers) == bool(args.node or args.this_node):
        raise ValueError("name the workers to drain, or --node / --this-node (one of them)")
    if not args.timeout >= 0:
        raise ValueError(f"--timeout must be >= 0, got {args.timeout}")
    runtime = RayRuntime(args.ray_address)
    runtime.start()
    try:
        node = ray.get_runtime_context().get_node_id() if args.this_node else args.node
        targets = control.find_workers(args.workers, node, args.deployment)
        if not targets:
            print(f"tandem drain: no tandem worker on node {node}", file=sys.stderr)
            return 0
        names = ", ".join(wid for _, wid in targets)
        print(f"tandem drain: draining {names} (up to {args.timeout:g}s)", file=sys.stderr,
              flush=True)
        control.request_drain(targets, args.timeout)
        outcomes = control.wait_drained(targets, time.monotonic() + args.timeout + ANSWER_MARGIN_S)
    finally:
        runtime.stop()
    print(json.dumps(outcomes, indent=2, sort_keys=True))
    return 0 if all("error" not in o for o in outcomes.values()) else 1
