"""Placement that cannot collide: one GPU per NCCL rank (validated with a clear error),
a GPU per worker by default on CUDA, the device index a worker actor really has, the
transport of each pair picked by device UUID, and pairs met in an order that cannot
deadlock."""

from __future__ import annotations

import itertools
import threading

import pytest

from tandem.common.config import ClusterConfig, EngineConfig
from tandem.transfer.nccl_channel import pair_order
from tandem.transfer.placement import pair_transports
from tandem.worker.device import resolve_device

CUDA = EngineConfig(device="cuda")


def test_gpus_per_worker_defaults_to_one_gpu_on_cuda_and_none_on_cpu():
    assert ClusterConfig(engine=CUDA).gpus_per_worker == 1.0
    assert ClusterConfig().gpus_per_worker == 0.0
    assert ClusterConfig(engine=CUDA, gpus_per_worker=0.5).gpus_per_worker == 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(engine=CUDA, transfer_backend="nccl", gpus_per_worker=0.5),
     "two NCCL ranks would share one GPU"),
    (dict(engine=CUDA, transfer_backend="nccl", gpus_per_worker=0), "share one GPU"),
    (dict(transfer_backend="nccl"), "needs --device cuda"),
    (dict(engine=CUDA, transfer_backend="gloo"), "gloo moves host memory"),
    (dict(gpus_per_worker=1), "GPUs are for --device cuda"),
    (dict(engine=CUDA, gpus_per_worker=-1), "gpus_per_worker must be >= 0"),
])
def test_placements_that_would_collide_or_cannot_work_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def test_sharing_gpus_is_fine_with_auto_and_in_colocated_mode():
    ClusterConfig(engine=CUDA, gpus_per_worker=0.5)  # same-GPU pairs use CUDA IPC
    ClusterConfig(engine=CUDA, gpus_per_worker=0.5, transfer_backend="nccl", mode="colocated",
                  prefill_workers=0)  # no KV moves between workers
    ClusterConfig(engine=CUDA, transfer_backend="nccl")  # one GPU each by default


@pytest.mark.parametrize("configured, gpu_ids, visible, expected", [
    ("cpu", ["3"], "3", "cpu"),
    ("cuda", ["3"], "3", "cuda:0"),  # Ray narrowed the visible devices to the assigned one
    ("cuda", ["3"], None, "cuda:3"),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all visible
    ("cuda", [5], "4,5,6", "cuda:1"),  # the node was started with some GPUs visible
    ("cuda:1", ["2", "7"], "2,7", "cuda:1"),  # the second GPU assigned to the worker
    ("cuda", [], None, "cuda:0"),  # no Ray GPUs (shared device): the configured one
    ("cuda:2", [], "0,1,2", "cuda:2"),
])
def test_the_device_index_is_the_gpu_ray_assigned(configured, gpu_ids, visible, expected):
    assert resolve_device(configured, gpu_ids, visible) == expected


@pytest.mark.parametrize("configured, gpu_ids, visible, message", [
    ("cuda:1", ["3"], "3", "assigned 1 GPU"),
    ("cuda", ["3"], "0,1", "not among CUDA_VISIBLE_DEVICES"),
    ("cuda", ["GPU-1234"], None, "not an index"),
])
def test_a_device_that_cannot_be_found_is_a_clear_error(configured, gpu_ids, visible, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(configured, gpu_ids, visible)


def test_pairs_on_one_gpu_use_ipc_and_the_others_nccl():
    uuids = {0: "GPU-a", 1: "GPU-b", 2: "GPU-a", 3: "GPU-c"}
    t = pair_transports("auto", True, uuids, [0, 1], [2, 3])
    assert t[0] == {2: "ipc", 3: "nccl"} and t[1] == {2: "nccl", 3: "nccl"}
    assert t[2] == {0: "ipc", 1: "nccl"} and t[3] == {0: "nccl", 1: "nccl"}
    assert pair_transports("nccl", True, {0: "a", 1: "b"}, [0], [1]) == {0: {1: "nccl"},
                                                                         1: {0: "nccl"}}


def test_cpu_pairs_use_gloo_whatever_the_uuids():
    assert pair_transports("auto", False, {0: None, 1: None}, [0], [1]) == {0: {1: "gloo"},
                                                                           1: {0: "gloo"}}
    assert pair_transports("gloo", False, {}, [0, 1], [2])[2] == {0: "gloo", 1: "gloo"}


def test_forcing_nccl_onto_one_gpu_names_the_workers_and_the_fix():
    with pytest.raises(ValueError, match=r"prefill-0 and decode-0 run on the same GPU \(GPU-a\)"
                                         r".*--transfer-backend auto"):
        pair_transports("nccl", True, {0: "GPU-a", 1: "GPU-a"}, [0], [1],
                        {0: "prefill-0", 1: "decode-0"})
    with pytest.raises(ValueError, match="has no CUDA device"):
        pair_transports("auto", True, {0: "GPU-a", 1: None}, [0], [1])


@pytest.mark.parametrize("prefill, decode", [(1, 1), (2, 1), (1, 3), (3, 2), (4, 4)])
def test_meeting_pairs_in_pair_order_never_deadlocks(prefill, decode):
    """Every rank meets its peers one at a time, each meeting blocking until the peer
    comes to it too (as a communicator init does); all meetings complete."""
    ranks = list(range(prefill + decode))
    peers = {r: list(range(prefill, prefill + decode)) if r < prefill else list(range(prefill))
             for r in ranks}
    barriers = {frozenset(p): threading.Barrier(2, timeout=10)
                for p in itertools.product(range(prefill), range(prefill, prefill + decode))}
    met: dict[int, list[int]] = {r: [] for r in ranks}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            for peer in pair_order(rank, peers[rank]):
                barriers[frozenset((rank, peer))].wait()
                met[rank].append(peer)
        except BaseException as e:  # a broken barrier: the ranks waited on each other
            errors.append(e)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(sorted(met[r]) == sorted(peers[r]) for r in ranks)


def test_both_ends_of_a_pair_get_one_unique_id_and_the_meeting_point_is_cleaned(tmp_path):
    from tandem.transfer.nccl_channel import exchange_unique_id, pair_key
    from tandem.transfer.rendezvous import FileRendezvous

    meet = FileRendezvous(tmp_path / "meet")
    key = pair_key("g", 3, 1)
    assert key == pair_key("g", 1, 3)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("higher", exchange_unique_id(
        meet, key, False, 10.0, lambda: pytest.fail("only the lower rank makes the id"))))
    t.start()
    got["lower"] = exchange_unique_id(meet, key, True, 10.0, lambda: (-5, 7, 127))
    t.join(10)
    assert got == {"lower": (-5, 7, 127), "higher": (-5, 7, 127)}
    assert not list((tmp_path / "meet").iterdir())
    with pytest.raises(TimeoutError):  # the peer never comes: bounded, and nothing left behind
        exchange_unique_id(meet, key, True, 0.05, lambda: (1,))
    assert not list((tmp_path / "meet").iterdir())
