"""The same-device channel: prefill and decode on one GPU, KV copied device to device.

NCCL refuses two ranks on one GPU; on one device no network is needed anyway.
A pair talks over a local authenticated connection (``multiprocessing.connection``,
a pipe or a Unix socket); torch's multiprocessing reductions share the CUDA
memory a message names through CUDA IPC (the sender's KV cache planes or staging
buffer, opened once per allocation by the receiver and cached), so no byte goes
through the host:

    send(data):  record an interprocess event E on the pair's stream (data complete)
                 -> message (data's shared view, E's handle)
                 -> wait for the receiver's answer: the handle of its read event R
                 -> the pair's stream waits R (device-side): later work on it (the
                    next gather into the same staging, freeing the blocks once an
                    event after it completed) runs after the copy read the bytes
    recv(buf):   message -> the pair's stream waits E -> copy into ``buf`` (the
                 reserved blocks, or staging) -> record R -> answer R's handle

So the decode side stays the only writer of its cache: a transfer aborted there
is stopped without a round trip to the prefill side, as on every other channel.
The pull direction (the decode worker reads the prefill worker's shared cache)
keeps that invariant. Every wait is bounded by the deadline except an idle
receive; a closed or dead peer's connection ends (EOF) and breaks the channel.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reductions on the pickler

from tandem.transfer.channel import ChannelBase, ChannelBrokenError
from tandem.transfer.nccl_channel import pair_key, pair_order
from tandem.transfer.rendezvous import Rendezvous
from tandem.transfer.device_sync import DeviceSync

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.2  # how often an idle receive checks whether the channel was closed


class IpcChannel(ChannelBase):
    """This rank's same-device pairs, one connection each (``links``: peer -> connection)."""

    def __init__(self, rank: int, world_size: int, links: Mapping[int, Connection],
                 sync: DeviceSync, op_timeout_s: float = 30.0,
                 senders: Sequence[int] = ()) -> None:
        """``senders``: the peers whose KV this rank receives (warm-up direction)."""
        super().__init__(rank, world_size, list(links), sync, op_timeout_s)
        self._links = dict(links)
        self._last_read: dict[int, object] = {}
        for peer in pair_order(rank, self.peers):
            self._warm_up(peer, receive=peer in senders)

    @classmethod
    def connect(cls, rank: int, world_size: int, peers: Sequence[int], group_name: str,
                sync: DeviceSync, rendezvous: Rendezvous, timeout_ms: int = 30_000,
                op_timeout_s: float = 30.0, senders: Sequence[int] = ()) -> IpcChannel:
        """Meet each peer through ``rendezvous``: the receiving side listens on a private
        Unix socket and publishes its address and a random key; the sending side connects."""
        timeout_s = timeout_ms / 1000
        links: dict[int, Connection] = {}
        try:
            for peer in pair_order(rank, peers):
                key = pair_key(group_name, rank, peer) + "-ipc"
                if peer in senders:
                    links[peer] = _accept(rendezvous, key, timeout_s)
                else:
                    address, _, authkey = rendezvous.get(key, timeout_s).decode().partition("\n")
                    links[peer] = Client(address, family="AF_UNIX",
                                         authkey=bytes.fromhex(authkey))
            return cls(rank, world_size, links, sync, op_timeout_s, senders)
        except BaseException:
            for conn in links.values():
                conn.close()
            raise

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        stream = self.stream(dst_rank)
        self._check_bytes(data, "send")
        with self._failing("send", dst_rank):
            ready = self.sync.record_event(stream, interprocess=True)
            with self.sync.use(stream):  # torch's reduction records its own event here too
                self._links[dst_rank].send(("kv", data, self.sync.export_event(ready)))
            kind, handle = self._receive(dst_rank, idle=False)
            if kind != "read":
                raise ConnectionError(f"expected a read answer from rank {dst_rank}, got {kind!r}")
            self.sync.wait_event(stream, self.sync.import_event(handle))

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        stream = self.stream(src_rank)
        self._check_bytes(buf, "recv")
        with self._failing("recv", src_rank), self.sync.use(stream):
            kind, data, handle = self._receive(src_rank, idle)
            if kind != "kv" or data.numel() != buf.numel():
                raise ConnectionError(f"a message of {data.numel()} bytes from rank {src_rank} "
                                      f"for a receive of {buf.numel()}")
            self.sync.wait_event(stream, self.sync.import_event(handle))
            buf.copy_(data, non_blocking=True)
            read = self.sync.record_event(stream, interprocess=True)
            del data  # the shared view: the sender's memory is not ours to keep
            # kept until the next message from this peer, which comes only after the sender
            # opened it (an event destroyed before its handle is opened cannot be waited for)
            self._last_read[src_rank] = read
            self._links[src_rank].send(("read", self.sync.export_event(read)))

    def _receive(self, peer: int, idle: bool) -> tuple:
        """The next message from ``peer``; bounded by the deadline unless ``idle``."""
        conn = self._links[peer]
        waited = 0.0
        while not conn.poll(IDLE_POLL_S if idle else min(IDLE_POLL_S, self.op_timeout_s)):
            if self.broken is not None:
                raise ChannelBrokenError(f"transfer channel broken: {self.broken}")
            waited += IDLE_POLL_S
            if not idle and waited >= self.op_timeout_s:
                raise TimeoutError(f"no message from rank {peer} within {self.op_timeout_s:g}s")
        try:
            return conn.recv()
        except EOFError:
            raise ConnectionError(f"rank {peer} closed the connection") from None

    @contextlib.contextmanager
    def _failing(self, op: str, peer: int) -> Iterator[None]:
        """Any failure but a known break breaks the channel (the pair is out of step)."""
        try:
            yield
        except ChannelBrokenError:
            raise
        except Exception as e:
            self.broken = self.broken or f"{op} with rank {peer}: {type(e).__name__}: {e}"
            self._close_links()
            raise

    def _expired(self, what: str) -> None:
        super()._expired(what)
        self._close_links()

    def _close_links(self) -> None:
        for conn in self._links.values():
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        """Leave: the connections end, so the peer's pending receive sees EOF."""
        self.broken = self.broken or "closed"
        self._close_links()


def _accept(rendezvous: Rendezvous, key: str, timeout_s: float) -> Connection:
    """Listen on a fresh private Unix socket, publish it with a one-time key, take one peer."""
    authkey = secrets.token_bytes(32)
    listener = Listener(family="AF_UNIX", authkey=authkey)  # in a private temporary directory
    try:
        rendezvous.put(key, f"{listener.address}\n{authkey.hex()}".encode())
        listener._listener._socket.settimeout(timeout_s)  # accept is bounded like the rest
        conn = listener.accept()
    finally:
        rendezvous.delete(key)
        listener.close()  # the socket file goes; the accepted connection stays
    return conn
