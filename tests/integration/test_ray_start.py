"""RayRuntime: a Ray that tandem serve starts is a loopback-only single-node cluster, and
stopping it puts this process's environment back."""

from __future__ import annotations

import os

import pytest

from tandem.cluster.ray_start import SINGLE_NODE_ENV, RayRuntime, loopback_env, loopback_interface


def test_loopback_env_names_the_loopback_interface():
    lo = loopback_interface()
    assert lo.startswith("lo")
    assert loopback_env() == {SINGLE_NODE_ENV: "0", "GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def test_a_started_ray_has_a_loopback_node_address_and_the_environment_is_restored(monkeypatch):
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        pytest.skip("Ray is already running in this process")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-before")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv(SINGLE_NODE_ENV, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    runtime = RayRuntime()
    assert runtime.start() is True
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
        assert RayRuntime().start() is False  # a second one joins nothing and owns nothing
    finally:
        runtime.stop()
    assert not ray.is_initialized()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth-before"
    assert "NCCL_SOCKET_IFNAME" not in os.environ and SINGLE_NODE_ENV not in os.environ
    assert ray_constants.ENABLE_RAY_CLUSTER == before


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:6379", True), ("localhost:6379", True), ("127.0.0.2:6379", True),
    ("[::1]:6379", True), ("ray://127.0.0.1:10001", True),
    ("10.0.0.5:6379", False), ("ray-head.serving.svc:6379", False), ("[fd00::5]:6379", False)])
def test_a_loopback_ray_address_is_recognised(address, loopback):
    from tandem.cluster.ray_start import is_loopback_address

    assert is_loopback_address(address) is loopback
