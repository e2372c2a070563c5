"""A CPU worker on a Ray cluster it joined sizes its torch threads on its own node: the
CPUs the node advertises to Ray, shared among as many workers as the node's custom
resource for the worker's pool admits."""

from __future__ import annotations

import pytest

from services.worker.threads import node_threads, share_of_node


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
