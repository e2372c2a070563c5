"""Starting (or joining) Ray for ``tandem serve``, with a locally started Ray kept on loopback.

A Ray that ``tandem serve`` starts itself is a single-node cluster with no reason to be
reachable from elsewhere, so every process of it listens on loopback only:

- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's single-node switch (its default on
  macOS and Windows): the node address becomes 127.0.0.1, and with it the GCS, the
  raylet and object manager, the workers' gRPC servers, the dashboard agent, the
  runtime-env agent and the autoscaler's metrics server bind 127.0.0.1 instead of all
  interfaces;
- ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name the loopback interface, so the
  gloo pair sockets and NCCL's bootstrap and data sockets bind it too (the gloo
  rendezvous store binds the node address: ``tandem.transfer.store``).

The settings go into this process's environment before Ray starts: the GCS and the
raylet are children of this process and the workers children of the raylet, so all of
them inherit it. ``stop()`` puts the environment back.

Joining an existing cluster (``ray_address``) changes nothing: a multi-node cluster must
be reachable from its other nodes, and its nodes were started by someone else. Except
that a loopback address (a Ray on this machine kept on loopback, e.g. several nodes for
a test) is joined with the single-node switch on: Ray otherwise rewrites ``127.0.0.1``
into the host's network address, where such a Ray does not listen. ``env`` adds settings
for the join (a local ``tandem serve``'s Ray token: ``local_serves``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

LOOPBACK = "127.0.0.1"
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    loops = [n for n in names if n.startswith("lo")]
    if not loops:
        raise RuntimeError(f"no loopback network interface among {names}")
    return loops[0]


def loopback_env() -> dict[str, str]:
    """Environment that keeps a single-node Ray and its collectives on loopback."""
    lo = loopback_interface()
    return {SINGLE_NODE_ENV: "0", "GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``host:port``, ``[v6]:port``, ``ray://host:port``) names
    this machine's loopback interface."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RayRuntime:
    """Ray for one ``Cluster``: joined at ``address``, or started locally on loopback.

    ``start()`` returns whether this object started (and so owns) the Ray instance;
    ``stop()`` shuts an owned instance down and restores the environment. ``env``: set
    in this process's environment while joined at ``address`` (``None`` values unset).
    """

    def __init__(self, address: str | None = None,
                 env: Mapping[str, str | None] | None = None) -> None:
        self.address = address
        self.env = dict(env or {})
        self.owns = False
        self._saved_env: dict[str, str | None] = {}
        self._saved_single_node: bool | None = None

    def start(self) -> bool:
        import ray

        if ray.is_initialized():
            return False
        if self.address is not None:
            env = dict(self.env)
            if is_loopback_address(self.address):
                env[SINGLE_NODE_ENV] = "0"
            self._apply(env)
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except BaseException:
                self._restore()
                raise
        else:
            self._apply(loopback_env())
            try:
                ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                         _node_ip_address=LOOPBACK)
            except BaseException:
                self._restore()
                raise
        self.owns = True
        return True

    def stop(self) -> None:
        import ray

        if self.owns:
            ray.shutdown()
            self.owns = False
        self._restore()

    def _apply(self, env: Mapping[str, str | None]) -> None:
        from ray._private import ray_constants

        for name, value in env.items():
            self._saved_env.setdefault(name, os.environ.get(name))
            _set_env(name, value)
        if set(env) & set(AUTH_ENV):
            _reload_auth_settings()
        if env.get(SINGLE_NODE_ENV) == "0":
            # Ray reads the single-node switch once, when it is first imported; ray.init
            # below resolves this node's address with it, so the value imported must agree.
            self._saved_single_node = ray_constants.ENABLE_RAY_CLUSTER
            ray_constants.ENABLE_RAY_CLUSTER = False

    def _restore(self) -> None:
        for name, value in self._saved_env.items():
            _set_env(name, value)
        if set(self._saved_env) & set(AUTH_ENV):
            _reload_auth_settings()
        self._saved_env = {}
        if self._saved_single_node is not None:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._saved_single_node
            self._saved_single_node = None


def _reload_auth_settings() -> None:
    """Make Ray read its token settings from the environment again (it keeps what it read
    first, as its own ``ray.init`` knows when it turns token authentication on)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token authentication
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
