"""Point-to-point byte channels between the workers of one transfer group.

``KVChannel`` is the narrow interface the KV protocol speaks: ``send``/``recv``
of contiguous uint8 tensors between ranks, queued on a device stream per peer
(``stream(peer)``), and bounded host waits for the events recorded after them
(``wait``). Every operation is bounded by the channel's deadline
(``op_timeout_s``) except a receive marked ``idle``. A channel that failed or
timed out once is ``broken`` for good: the stream is out of step, so the
worker reports not-alive and the cluster rebuilds the group.

Implementations: ``CollectiveChannel`` (gloo through torch.distributed, the
CPU twin, here), ``NcclChannel`` (one 2-rank NCCL communicator per peer on
non-blocking streams, ``nccl_channel.py``) and ``IpcChannel`` (same-device
pairs over CUDA IPC, ``ipc_channel.py``); ``endpoint.open_channel`` picks.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from tandem.transfer.device_sync import CpuSync, DeviceSync, Event, Stream, wait_until_done

log = logging.getLogger(__name__)
IDLE_WAIT = datetime.timedelta(days=3650)  # an idle peer is not a failure


class ChannelBrokenError(ConnectionError):
    """The channel failed or timed out earlier; the group must be rebuilt."""


class KVChannel(Protocol):
    """Byte messages between ranks, each peer's on a device stream of its own.

    ``send``/``recv`` are queued on ``stream(peer)`` (the work the caller queued there
    before runs first): on CUDA they return once queued, and the bytes have moved when
    an event recorded on that stream after them has completed (``wait``); on the CPU
    twin they return once done. Each is bounded by the channel's deadline
    (``op_timeout_s``) except a receive marked ``idle`` (the wait for the next message
    from a peer that may have nothing to send for hours).
    """

    rank: int
    world_size: int
    device: torch.device
    sync: DeviceSync
    peers: tuple[int, ...]  # the ranks this one exchanges KV with
    broken: str | None  # why the channel is unusable; None while healthy
    lost: dict[int, str]  # optional peers lost (why), the rest of the channel still usable

    def stream(self, peer: int) -> Stream:
        """The stream this rank's transfer work with ``peer`` is queued on."""
        ...

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        """Queue the send of a contiguous uint8 tensor (or raise, at the latest after
        the channel's deadline)."""
        ...

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        """Queue the receive of exactly ``buf.numel()`` bytes from ``src_rank`` into ``buf``."""
        ...

    def wait(self, event: Event, what: str, idle: bool = False) -> None:
        """Block this (non-compute) thread until ``event``, recorded on one of this
        channel's streams, completed; bounded by the deadline unless ``idle``. A timeout
        breaks the channel; a broken channel raises ``ChannelBrokenError``."""
        ...

    def close(self) -> None: ...


class ChannelBase:
    """What every channel shares: peers, per-peer streams, bounded host waits, ``broken``."""

    def __init__(self, rank: int, world_size: int, peers: Sequence[int], sync: DeviceSync,
                 op_timeout_s: float, optional: Sequence[int] = ()) -> None:
        """``optional``: peers whose failure loses only them (``lost``), not the channel
        (a decode worker's fellow decode workers, reached only to move requests)."""
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self.rank, self.world_size, self.peers = rank, world_size, tuple(peers)
        self.sync, self.device, self.op_timeout_s = sync, sync.device, op_timeout_s
        self.broken: str | None = None
        self.optional = frozenset(optional)
        self.lost: dict[int, str] = {}
        self._streams = {p: sync.new_stream(f"kv-{rank}-{p}") for p in self.peers}

    def stream(self, peer: int) -> Stream:
        try:
            return self._streams[peer]
        except KeyError:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} "
                             f"(peers {list(self.peers)})") from None

    def check_usable(self, peer: int | None = None) -> None:
        """Raise ``ChannelBrokenError`` once the channel is broken (or ``peer`` lost)."""
        if self.broken is not None:
            raise ChannelBrokenError(f"transfer channel broken: {self.broken}")
        if peer in self.lost:
            raise ChannelBrokenError(f"rank {peer} lost: {self.lost[peer]}")

    def _failed(self, peer: int, why: str) -> None:
        """An operation with ``peer`` failed: an optional peer is lost, else the channel
        is broken."""
        if peer in self.optional:
            self.lost.setdefault(peer, why)
        else:
            self.broken = self.broken or why

    def _check_bytes(self, tensor: torch.Tensor, op: str) -> None:
        """A usable channel and a contiguous uint8 ``tensor`` on its device (device channels)."""
        self.check_usable()
        if tensor.device != self.device or tensor.dtype != torch.uint8 \
                or not tensor.is_contiguous():
            raise ValueError(f"{op} takes a contiguous uint8 tensor on {self.device}, "
                             f"got {tensor.dtype} on {tensor.device}")

    def wait(self, event: Event, what: str, idle: bool = False) -> None:
        self.check_usable()
        try:
            wait_until_done(self.sync, event, None if idle else self.op_timeout_s,
                            self._why_broken, what)
        except TimeoutError as e:
            self._expired(str(e))
            raise ChannelBrokenError(f"transfer channel broken: {self.broken}") from e
        except ConnectionError as e:
            raise ChannelBrokenError(str(e)) from e

    def _warm_up(self, peer: int, receive: bool) -> None:
        """One byte across the pair, waited for, so that "connected" means connected
        (NCCL, for one, sets up its p2p path on first use)."""
        stream = self.stream(peer)
        with self.sync.use(stream):
            byte = torch.ones(1, dtype=torch.uint8, device=self.device)
            if receive:
                self.recv(byte, peer)
            else:
                self.send(byte, peer)
            done = self.sync.record_event(stream)
        self.wait(done, f"warm-up with rank {peer}")

    def _why_broken(self) -> str | None:
        """Polled while waiting: why the awaited work can never complete (None: it may)."""
        return self.broken

    def _expired(self, what: str) -> None:
        """A bounded operation outlived its deadline: the channel is out of step for good."""
        self.broken = self.broken or what

    def close(self) -> None:
        """Leave; implementations also end what their peers wait on."""
        self.broken = self.broken or "closed"


class CollectiveChannel(ChannelBase):
    """A rank of the gloo transfer group (the CPU twin); call from inside a Ray actor.

    Ray's gloo group sits on torch's default process group, created without a
    timeout (torch's 30-minute default), and its send/recv take none; so calls go
    to torch.distributed directly, as ``isend``/``irecv`` whose ``wait(timeout)``
    bounds each one (a gloo timeout closes the pair: the channel is then broken, or
    only that peer lost where it is optional).
    One group spans every prefill and decode worker (a second pairwise gloo group
    in one process hangs). Synchronous: its events are complete when recorded.
    """

    def __init__(self, world_size: int, rank: int, group_name: str, peers: Sequence[int],
                 timeout_ms: int = 30_000, op_timeout_s: float = 30.0,
                 optional: Sequence[int] = ()) -> None:
        import ray.util.collective as col
        import torch.distributed as dist

        from tandem.transfer.store import init_gloo_default_group

        super().__init__(rank, world_size, peers, CpuSync(), op_timeout_s, optional)
        self._col = col
        self.group_name = group_name
        if not dist.is_initialized():  # rendezvous on a store bound to the node address
            init_gloo_default_group(world_size, rank, group_name, timeout_ms)
        col.init_collective_group(world_size, rank, backend="gloo", group_name=group_name,
                                  gloo_timeout=timeout_ms)

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self._call("send", data, dst_rank, False)

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self._call("recv", buf, src_rank, idle)

    def _call(self, op: str, tensor: torch.Tensor, peer: int, idle: bool) -> None:
        import torch.distributed as dist

        self.check_usable(peer)
        try:
            work = (dist.isend if op == "send" else dist.irecv)(tensor, peer)
            work.wait(timeout=IDLE_WAIT if idle else datetime.timedelta(seconds=self.op_timeout_s))
        except Exception as e:
            self._failed(peer, f"{op} with rank {peer}: {type(e).__name__}: {e}")
            raise

    def close(self) -> None:
        """Leave the group; peers blocked on this rank see their calls fail."""
        import torch.distributed as dist

        self.broken = self.broken or "closed"
        try:
            self._col.destroy_collective_group(self.group_name)
        except Exception:  # the group may already be broken by a dead peer
            pass
        if dist.is_initialized():  # ray's gloo group sits on the default process group
            dist.destroy_process_group()
