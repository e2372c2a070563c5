"""The gloo transfer group's rendezvous store, bound to this node's address only.

``ray.util.collective``'s own gloo rendezvous lets torch create the ``TCPStore`` on
rank 0, and torch binds that store to every interface. Here rank 0 binds a socket to
the Ray node's address (127.0.0.1 on a Ray that ``tandem serve`` started; the pod or
host address of a multi-node cluster), hands it to ``TCPStore`` (``master_listen_fd``)
and publishes ``host:port`` in Ray's internal KV; the other ranks connect to it. With
the default process group initialised on that store, ``ray.util.collective`` skips its
own rendezvous and builds the named group on top.

The gloo pair sockets bind the same address: unless ``GLOO_SOCKET_IFNAME`` is set (a
Ray that ``tandem serve`` started sets it to loopback), it is set to the interface that
carries the node address, instead of torch's default (the address the host name
resolves to, 127.0.1.1 on many Linux hosts: unreachable from other nodes).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import time

STORE_KEY_PREFIX = "tandem-gloo-store-"


def _key(group_name: str) -> str:
    return STORE_KEY_PREFIX + group_name


def _bound_socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 ``address`` (None: none does,
    or the address is not IPv4, or the platform cannot tell)."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ipaddress.AddressValueError:
        return None
    if wanted.is_loopback:  # all of 127/8 is on the loopback interface
        wanted = ipaddress.IPv4Address("127.0.0.1")
    siocgifaddr = 0x8915  # Linux
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24]
            except OSError:  # no IPv4 address, or not Linux
                continue
            if ipaddress.IPv4Address(got) == wanted:
                return name
    return None


def bind_gloo_to(address: str) -> None:
    """Make gloo's pair sockets use the interface of ``address`` (unless already set)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def init_gloo_default_group(world_size: int, rank: int, group_name: str, timeout_ms: int) -> None:
    """Initialise torch.distributed's default gloo group over a node-address-bound store.

    Blocks until every rank has joined (or ``timeout_ms`` passes: TimeoutError).
    """
    import ray
    import torch.distributed as dist
    from ray.experimental import internal_kv

    timeout = datetime.timedelta(milliseconds=timeout_ms)
    key = _key(group_name)
    bind_gloo_to(ray.util.get_node_ip_address())
    if rank == 0:
        host = ray.util.get_node_ip_address()
        sock = _bound_socket(host)
        port = sock.getsockname()[1]
        # The store owns the descriptor from here on (it closes it).
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.detach())
        internal_kv._internal_kv_put(key, f"{host}:{port}", overwrite=True)
    else:
        deadline = time.monotonic() + timeout_ms / 1000
        while (address := internal_kv._internal_kv_get(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 of transfer group {group_name!r} did not publish "
                                   f"its store within {timeout_ms} ms")
            time.sleep(0.05)
        host, _, port = address.decode().rpartition(":")
        store = dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=False,
                              timeout=timeout)
    dist.init_process_group("gloo", store=store, world_size=world_size, rank=rank, timeout=timeout)
    if rank == 0:  # every rank is in: the address is no longer needed
        internal_kv._internal_kv_del(key)
