"""``tandem drain`` and ``tandem scale``: change the pools of a running gateway.

``tandem drain`` takes workers out without cutting a stream: named workers
(``decode-1``), or every worker on a Ray node (``--node ID``, or ``--this-node``: what a
worker pod's pre-stop hook runs before Kubernetes removes it). ``tandem scale --decode
N`` resizes a pool (new workers wait for room: an autoscaler's cue to add nodes;
surplus ones are drained). Each request goes to the gateway through the Ray cluster
(see ``control``); the command waits for the outcome, prints it as JSON and exits 0
when everything was done, 1 otherwise. Without ``--ray-address`` it talks to the
``tandem serve`` running on this machine (``local_serves``: ``--deployment`` or
``--port`` picks one of several), else to the Ray cluster this machine belongs to.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tandem.cluster.drain import DRAIN_TIMEOUT_S
from tandem.cluster.scale import ADD_TIMEOUT_S
from tandem.engine.progress import spinner

ANSWER_MARGIN_S = 60.0  # beyond the drain timeout: exiting the actor, a group rebuild


def _add_connection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster of the gateway (default: that of the tandem serve "
                   "running on this machine, else Ray's own 'auto': the cluster this node "
                   "belongs to)")
    p.add_argument("--deployment", default=None,
                   help="the gateway's --deployment (or gateway name), when several gateways "
                   "run on this machine or share the cluster")
    p.add_argument("--port", type=int, default=None,
                   help="the gateway's --port: picks one of several tandem serves on this machine")


def _join(args: argparse.Namespace):
    """``(RayRuntime, gateway name or None)``: Ray as ``--ray-address`` says, else that of
    the local serve ``--deployment`` / ``--port`` pick (its gateway's name with it), else
    Ray's ``auto``. Raises ``ValueError`` when the local serves leave it open."""
    from tandem.cluster import local_serves
    from tandem.cluster.ray_start import RayRuntime

    if args.ray_address is not None:
        if args.port is not None:
            raise ValueError("--port picks a tandem serve on this machine: not with --ray-address")
        return RayRuntime(args.ray_address), args.deployment
    serve = local_serves.find(args.deployment, args.port)
    if serve is None:
        return RayRuntime("auto"), args.deployment
    return RayRuntime(serve.ray_address, env=serve.ray_env()), serve.control_name


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workers", nargs="*", metavar="WORKER",
                   help="worker ids to drain, e.g. decode-1 (see tandem_worker_node_info)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--node", metavar="NODE_ID", help="drain every worker on this Ray node")
    where.add_argument("--this-node", action="store_true",
                       help="drain every worker on the Ray node this command runs on "
                       "(a worker pod's pre-stop hook); nothing there: exit 0 at once")
    _add_connection(p)
    p.add_argument("--timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="let running requests finish for up to S seconds; those still "
                   "running then are re-driven on other workers")


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, metavar="N", help="prefill workers wanted")
    p.add_argument("--decode", type=int, metavar="M", help="decode workers wanted")
    _add_connection(p)
    p.add_argument("--timeout", type=float, default=ADD_TIMEOUT_S, metavar="S",
                   help="how long new workers may wait for room (an autoscaler adding nodes)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="surplus workers: let running requests finish for up to S seconds, "
                   "then re-drive them")


def _report(outcomes: dict[str, dict]) -> int:
    print(json.dumps(outcomes, indent=2, sort_keys=True))
    return 0 if all("error" not in o for o in outcomes.values()) else 1


def scale_main(args: argparse.Namespace) -> int:
    from tandem.cluster import control

    wanted = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode))
              if n is not None}
    if not wanted:
        raise ValueError("say how many workers: --prefill N and/or --decode M")
    if any(n < 1 for n in wanted.values()):
        raise ValueError("a pool needs at least one worker")
    if not (args.timeout >= 0 and args.drain_timeout >= 0):
        raise ValueError("--timeout and --drain-timeout must be >= 0")
    runtime, name = _join(args)
    runtime.start()
    try:
        if name is None:
            names = control.gateway_names()
            if len(names) != 1:
                raise ValueError(f"{len(names)} gateways run on this Ray cluster "
                                 f"({', '.join(names) or 'none'}): name one with --deployment")
            name = names[0]
        outcomes = {}
        for role, n in wanted.items():  # one pool after the other
            target = [(name, role)]
            control.request("scale", target, {"workers": n, "timeout_s": args.timeout,
                                              "drain_timeout_s": args.drain_timeout})
            deadline = time.monotonic() + args.timeout + n * args.drain_timeout + ANSWER_MARGIN_S
            with spinner(f"tandem scale: {role} pool to {n} worker(s)"):  # on a terminal only
                outcomes |= control.wait_answers("scale", target, deadline)
    finally:
        runtime.stop()
    return _report(outcomes)


def drain_main(args: argparse.Namespace) -> int:
    import ray

    from tandem.cluster import control

    if bool(args.workers) == bool(args.node or args.this_node):
        raise ValueError("name the workers to drain, or --node / --this-node (one of them)")
    if not args.timeout >= 0:
        raise ValueError(f"--timeout must be >= 0, got {args.timeout}")
    runtime, name = _join(args)
    runtime.start()
    try:
        node = ray.get_runtime_context().get_node_id() if args.this_node else args.node
        targets = control.find_workers(args.workers, node, name)
        if not targets:
            print(f"tandem drain: no tandem worker on node {node}", file=sys.stderr)
            return 0
        names = ", ".join(wid for _, wid in targets)
        print(f"tandem drain: draining {names} (up to {args.timeout:g}s)", file=sys.stderr,
              flush=True)
        control.request_drain(targets, args.timeout)
        with spinner("tandem drain: waiting for the gateway") as waiting:  # on a terminal only
            outcomes = control.wait_drained(targets, time.monotonic() + args.timeout + ANSWER_MARGIN_S,
                                            lambda done, total: waiting.set_postfix(f"{done} of {total} drained"))
    finally:
        runtime.stop()
    return _report(outcomes)
