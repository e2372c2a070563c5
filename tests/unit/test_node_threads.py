"""A CPU worker on a Ray cluster it joined sizes its torch threads on its own node: the
CPUs the node advertises to Ray, shared among as many workers as the node's custom
resource for the worker's pool admits."""

from __future__ import annotations

import pytest

from tandem.worker.threads import node_threads, share_of_node, usable_cores


@pytest.mark.parametrize("asked,node,cores,expected", [
    ({"tandem_prefill": 1.0}, {"CPU": 4.0, "tandem_prefill": 1.0}, 64, 4),  # one worker a pod
    ({"tandem_prefill": 1.0}, {"CPU": 4.0, "tandem_prefill": 2.0}, 64, 2),  # workersPerPod 2
    ({"tandem_prefill": 1.0}, {"CPU": 5.0, "tandem_prefill": 2.0}, 64, 2),  # rounded down
    ({"tandem_prefill": 1.0}, {"CPU": 1.0, "tandem_prefill": 4.0}, 64, 1),  # at least one
    ({"tandem_prefill": 0.5}, {"CPU": 8.0, "tandem_prefill": 1.0}, 64, 4),  # fractional asks
    ({"tandem_decode": 1.0}, {"CPU": 16.0, "tandem_decode": 1.0}, 6, 6),  # at most the usable cores
    ({"tandem_decode": 1.0, "fast": 1.0}, {"CPU": 8.0, "tandem_decode": 4.0, "fast": 2.0}, 64, 4),
    ({}, {"CPU": 16.0}, 64, 1),  # no custom resource: nothing bounds the workers sharing the node
    ({"CPU": 2.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 8.0}, 64, 1),  # Ray's own resources bound nothing
    ({"accelerator_type:H100": 0.001}, {"CPU": 16.0, "accelerator_type:H100": 1.0}, 64, 1),
    ({"tandem_prefill": 1.0}, {"tandem_prefill": 1.0}, 64, 1),  # a node advertising no CPUs
])
def test_share_of_node(asked, node, cores, expected):
    assert share_of_node(asked, node, cores) == expected


def test_outside_an_actor_nothing_is_decided():
    assert node_threads() is None


class _Context:
    def get_actor_id(self):
        return "actor"

    def get_node_id(self):
        return "node-a"

    def get_assigned_resources(self):
        return {"tandem_decode": 1.0}


@pytest.mark.parametrize("nodes,expected", [
    (lambda: [{"NodeID": "node-b", "Resources": {"CPU": 64.0, "tandem_decode": 1.0}}], 1),  # not found
    (lambda: (_ for _ in ()).throw(ConnectionError("GCS unreachable")), 1),  # Ray's lookup fails
])
def test_in_an_actor_a_failed_lookup_falls_back_to_one_thread(monkeypatch, nodes, expected):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", _Context)
    monkeypatch.setattr(ray, "nodes", nodes)
    assert node_threads() == expected


def test_in_an_actor_the_node_is_read_from_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", _Context)
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"NodeID": "node-b", "Resources": {"CPU": 8.0, "tandem_decode": 1.0}},
        {"NodeID": "node-a", "Resources": {"CPU": 2.0, "tandem_decode": 1.0}}])
    assert node_threads() == min(2, usable_cores())  # node-a's two CPUs, not node-b's eight
