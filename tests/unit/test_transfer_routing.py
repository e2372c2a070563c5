"""One channel over several transports: ``open_channel`` builds a part per transport (NCCL
pairs first, then IPC, on every rank alike) and the routed channel sends each peer's
messages over its pair's part; one broken part breaks the whole."""

from __future__ import annotations

import pytest
import torch

from tandem.transfer import endpoint
from tandem.transfer.channel import ChannelBase
from tandem.transfer.routed import RoutedChannel
from tandem.transfer.device_sync import CpuSync


class Part(ChannelBase):
    def __init__(self, kind: str, rank: int, peers, calls: list) -> None:
        super().__init__(rank, 4, peers, CpuSync(), 30.0)
        self.kind, self.calls = kind, calls

    def send(self, data, dst_rank):
        self.calls.append((self.kind, "send", dst_rank))

    def recv(self, buf, src_rank, idle=False):
        self.calls.append((self.kind, "recv", src_rank))


def test_each_peer_goes_over_its_pairs_transport(monkeypatch):
    built, calls = [], []

    def open_part(kind, rank, world, peers, group, sync, rendezvous, senders, timeout_ms, op):
        built.append((kind, list(peers), list(senders)))
        return Part(kind, rank, peers, calls)
    monkeypatch.setattr(endpoint, "_open_part", open_part)
    ch = endpoint.open_channel({1: "ipc", 2: "nccl", 3: "nccl"}, 4, 0, "g", CpuSync(),
                               senders=[1], rendezvous=object())
    assert built == [("nccl", [2, 3], [1]), ("ipc", [1], [1])]  # the same order on every rank
    assert isinstance(ch, RoutedChannel) and ch.peers == (1, 2, 3)
    one = torch.zeros(1, dtype=torch.uint8)
    ch.send(one, 1)
    ch.recv(one, 3)
    assert calls == [("ipc", "send", 1), ("nccl", "recv", 3)]
    with pytest.raises(ValueError, match="not a peer"):
        ch.send(one, 7)
    assert ch.broken is None
    ch.parts[1].broken = "rank 1 closed the connection"
    assert ch.broken == "rank 1 closed the connection"
    ch.close()
    assert all(p.broken for p in ch.parts)


def test_a_single_transport_is_its_channel_and_transports_are_not_mixed_with_gloo(monkeypatch):
    monkeypatch.setattr(endpoint, "_open_part", lambda kind, rank, world, peers, *a: Part(
        kind, rank, peers, []))
    ch = endpoint.open_channel({1: "nccl"}, 2, 0, "g", CpuSync(), rendezvous=object())
    assert isinstance(ch, Part) and ch.kind == "nccl"
    with pytest.raises(ValueError, match="cannot mix"):
        endpoint.open_channel({1: "nccl", 2: "gloo"}, 3, 0, "g", CpuSync(), rendezvous=object())
