"""The same-device transport on CPU: the IPC channel's messages and event order (with the
recording fake), the KV protocol over it, its connection through a rendezvous, a peer
leaving, and the two-process pair check the device check calls (its CPU dry run)."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest
import torch

from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.transfer.channel import ChannelBrokenError
from tandem.transfer.ipc_channel import IpcChannel
from tandem.transfer.receiver import KVReceiver
from tandem.transfer.rendezvous import FileRendezvous
from tandem.transfer.sender import KVSender, SendJob
from tandem.transfer.device_sync import CpuSync, RecordingSync


def _pair(sync_factory=CpuSync):
    """Rank 0 (sends) and rank 1 (receives) over a pipe; built concurrently (warm-up)."""
    a, b = Pipe()
    syncs = sync_factory(), sync_factory()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(1, IpcChannel(1, 2, {0: b}, syncs[1],
                                                                     10.0, senders=[0])))
    t.start()
    out[0] = IpcChannel(0, 2, {1: a}, syncs[0], 10.0)
    t.join(30)
    return out[0], out[1]


def test_a_message_is_read_after_its_event_and_the_sender_reuses_it_after_the_read():
    log: list = []
    shared = RecordingSync(log)  # both ends: event handles resolve within one fake
    send_ch, recv_ch = _pair(lambda: shared)
    log.clear()
    data = torch.arange(64, dtype=torch.uint8)
    buf = torch.zeros(64, dtype=torch.uint8)
    t = threading.Thread(target=lambda: recv_ch.recv(buf, 0))
    t.start()
    send_ch.send(data, 1)
    t.join(10)
    assert torch.equal(buf, data)
    kinds = [(e[0], e[1]) for e in log]
    assert kinds == [("record", "kv-0-1"),  # E: the data is complete on the sender's stream
                     ("wait", "kv-1-0"),  # the receiver's stream waits E, then copies
                     ("record", "kv-1-0"),  # R: the copy has read the data
                     ("wait", "kv-0-1")], log  # the sender's stream waits R before reusing it
    assert log[1][2] == log[0][2] and log[3][2] == log[2][2]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "gathered"])
def test_kv_blocks_arrive_intact_over_ipc(in_place):
    send_ch, recv_ch = _pair()
    src = PagedKVCache(4, 32, 16, 2, 16, torch.float32, torch.device("cpu"))
    dst = PagedKVCache(4, 32, 16, 2, 16, torch.float32, torch.device("cpu"))
    src.kv.normal_()
    reports = []
    sender = KVSender(send_ch, src.gather, src.block_shape, src.dtype, reports.append, src.plane,
                      src.plane_block_bytes, min_run_plane_bytes=1)
    receiver = KVReceiver(recv_ch, [0], dst.scatter, dst.block_shape, dst.dtype, dst.plane,
                          dst.plane_block_bytes)
    groups = [range(0, 2), range(2, 4)]
    src_blocks, dst_blocks = [3, 4, 5, 9], [10, 11, 12, 20]
    receiver.expect("t", 0, dst_blocks, groups)
    for g, layers in enumerate(groups):
        sender.submit(SendJob("t", 1, src_blocks, layers, g, g == 1,
                              dst_block_ids=dst_blocks if in_place else ()))
    pt = receiver.wait("t", 30)
    assert pt.status.name == "DONE", pt.error
    assert torch.equal(dst.kv[:, :, dst_blocks], src.kv[:, :, src_blocks])
    sender.close()
    assert reports and reports[0].ok
    assert sender.groups_in_place == (2 if in_place else 0)
    send_ch.close()
    recv_ch.close()


def test_pairs_meet_through_a_rendezvous_and_a_leaving_peer_breaks_the_other(tmp_path):
    rendezvous = FileRendezvous(tmp_path / "meet")
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(1, IpcChannel.connect(
        1, 2, [0], "g", CpuSync(), rendezvous, 10_000, 10.0, senders=[0])))
    t.start()
    out[0] = IpcChannel.connect(0, 2, [1], "g", CpuSync(), rendezvous, 10_000, 10.0)
    t.join(30)
    send_ch, recv_ch = out[0], out[1]
    assert not list((tmp_path / "meet").iterdir()), "the address and key are removed once met"
    dst = PagedKVCache(2, 8, 16, 2, 16, torch.float32, torch.device("cpu"))
    receiver = KVReceiver(recv_ch, [0], dst.scatter, dst.block_shape, dst.dtype)
    send_ch.close()  # the prefill side leaves while the receive for it is posted (idle)
    try:  # the receiver may already have seen the peer leave: then expect refuses
        pending = receiver.expect("never", 0, [1], [range(0, 2)])
    except ConnectionError:
        pending = None
    for _ in range(300):  # the channel breaks first; its receive thread then marks the peer dead
        if 0 in receiver.dead_peers:
            break
        threading.Event().wait(0.05)
    assert receiver.broken is not None and 0 in receiver.dead_peers
    if pending is not None:
        assert receiver.wait("never", 10).status.name == "FAILED"
    with pytest.raises(ChannelBrokenError):
        send_ch.send(torch.zeros(1, dtype=torch.uint8), 1)


def test_a_message_of_the_wrong_size_breaks_the_channel():
    send_ch, recv_ch = _pair()
    sent: list[BaseException] = []

    def send() -> None:
        try:
            send_ch.send(torch.zeros(8, dtype=torch.uint8), 1)
        except ConnectionError as e:  # the receiver hung up instead of answering
            sent.append(e)
    t = threading.Thread(target=send)
    t.start()
    with pytest.raises(ConnectionError, match="8 bytes from rank 0 for a receive of 4"):
        recv_ch.recv(torch.zeros(4, dtype=torch.uint8), 0)
    t.join(30)
    assert recv_ch.broken is not None and send_ch.broken is not None and sent


def test_the_two_process_pair_check_runs_its_plumbing_on_cpu():
    from tandem.transfer.pair_check import check_pair

    result = check_pair("ipc", ("cpu", "cpu"), num_blocks=4, repeats=2, dtype="float32",
                        timeout_s=60)
    assert result.error is None and result.intact, result
    assert result.kind == "ipc" and len(result.seconds) == 2 and result.num_bytes > 0
