"""The gloo transfer group binds the interface that carries the Ray node address."""

from __future__ import annotations

import os

from tandem.cluster.ray_start import loopback_interface
from tandem.transfer.store import bind_gloo_to, interface_of


def test_the_interface_of_a_loopback_address_is_the_loopback_interface():
    assert interface_of("127.0.0.1") == loopback_interface()
    assert interface_of("127.0.0.2") == loopback_interface()  # all of 127/8


def test_an_address_no_interface_holds_has_none():
    assert interface_of("198.51.100.254") is None  # TEST-NET-2: on no interface here
    assert interface_of("::1") is None  # IPv6: torch's default is kept
    assert interface_of("not-an-address") is None


def test_gloo_is_bound_to_the_node_interface_unless_the_operator_chose_one(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_gloo_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    bind_gloo_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
