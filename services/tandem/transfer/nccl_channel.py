"""The NCCL channel: one 2-rank communicator per peer, each on a non-blocking stream of its own.

Built on cupy's NCCL bindings directly rather than ``ray.util.collective``: Ray's
group queues sends and receives on *blocking* streams (the legacy default stream
waits for them, so a receive posted for an idle peer stalls compute), creates
communicators lazily on first use (not thread-safe, "connected" before anything
connected) and has no way to abort. Here:

* every pair meets at group creation (``Rendezvous``), in one global pair order
  so no two ranks wait for each other, builds its communicator and moves one
  byte prefill -> decode (warm-up): the group is connected when the constructor
  returns;
* a pair's sends and receives are queued on that pair's own non-blocking stream,
  so a header receive waiting for an idle peer blocks nothing but that stream;
* every call is guarded by the :class:`~tandem.transfer.watchdog.Watchdog`
  (queuing can block, e.g. on a wedged proxy) and every host wait is bounded
  (``ChannelBase.wait``); past a deadline the communicators are aborted
  (``ncclCommAbort``: the kernels in flight end), the channel is broken and the
  cluster rebuilds the group, as on CPU.

No heartbeat is needed to keep an idle pair's communicator: NCCL has no idle
timeout; the sender's heartbeat headers (``sender.py``) keep a path between
nodes warm and show a dead receiver within one interval.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from tandem.transfer.channel import ChannelBase, ChannelBrokenError
from tandem.transfer.rendezvous import Rendezvous
from tandem.transfer.device_sync import DeviceSync
from tandem.transfer.watchdog import Watchdog

log = logging.getLogger(__name__)


def pair_order(rank: int, peers: Sequence[int]) -> list[int]:
    """``peers`` in the order every rank meets its pairs: by (lower rank, higher rank).

    Each rank meets its pairs one at a time, blocking; the globally smallest pair
    not yet met is the next pair of both its ranks, so the whole group always
    makes progress (no cycle of ranks waiting for each other)."""
    return sorted(peers, key=lambda p: (min(rank, p), max(rank, p)))


def pair_key(group_name: str, a: int, b: int) -> str:
    lo, hi = sorted((a, b))
    return f"{group_name}-pair-{lo}-{hi}"


def exchange_unique_id(rendezvous: Rendezvous, key: str, lower: bool, timeout_s: float,
                       new_id: Callable[[], Sequence[int]]) -> tuple[int, ...]:
    """Meet the other end of a pair: the lower rank publishes a fresh unique id, the higher
    one takes it and confirms, so neither enters the (blocking) communicator init alone;
    both get the same id and the keys are gone afterwards. ``TimeoutError`` when the
    other end does not come within ``timeout_s``."""
    if lower:
        uid = tuple(new_id())
        rendezvous.put(key, json.dumps(list(uid)).encode())
        try:
            rendezvous.get(key + "-joined", timeout_s)
        finally:
            rendezvous.delete(key)
        rendezvous.delete(key + "-joined")
        return uid
    uid = tuple(json.loads(rendezvous.get(key, timeout_s)))
    rendezvous.put(key + "-joined", b"1")
    return uid


class NcclChannel(ChannelBase):
    """This rank's NCCL pairs with ``peers``; ``device`` is its own GPU (``cuda:N``)."""

    def __init__(self, rank: int, world_size: int, peers: Sequence[int], group_name: str,
                 sync: DeviceSync, rendezvous: Rendezvous, timeout_ms: int = 30_000,
                 op_timeout_s: float = 30.0, senders: Sequence[int] = ()) -> None:
        """``senders``: the peers that send KV to this rank (the warm-up's direction);
        the others receive from it."""
        from cupy.cuda import nccl

        super().__init__(rank, world_size, peers, sync, op_timeout_s)
        if sync.device.type != "cuda" or sync.device.index is None:
            raise ValueError(f"an NCCL channel needs an indexed CUDA device, got {sync.device}")
        self._nccl = nccl
        self.group_name = group_name
        self._comms: dict[int, object] = {}
        self._comms_lock = threading.Lock()  # error checks vs abort (which frees them)
        self._watchdog = Watchdog(self._expired)
        timeout_s = timeout_ms / 1000
        try:
            for peer in pair_order(rank, self.peers):
                with self._watchdog.guard(f"connecting to rank {peer}", timeout_s):
                    self._comms[peer] = self._connect(peer, rendezvous, timeout_s)
                self._warm_up(peer, receive=peer in senders)
        except BaseException:
            self.close()
            raise

    def _connect(self, peer: int, rendezvous: Rendezvous, timeout_s: float):
        import cupy

        nccl = self._nccl
        uid = exchange_unique_id(rendezvous, pair_key(self.group_name, self.rank, peer),
                                 self.rank < peer, timeout_s, nccl.get_unique_id)
        with cupy.cuda.Device(self.device.index):
            return nccl.NcclCommunicator(2, uid, self._pair_rank(peer))

    def _pair_rank(self, peer: int) -> int:
        return 0 if self.rank < peer else 1

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self._call("send", data, dst_rank, False)

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self._call("recv", buf, src_rank, idle)

    def _call(self, op: str, tensor: torch.Tensor, peer: int, idle: bool) -> None:
        self._check_bytes(tensor, f"NCCL {op}")
        stream, other = self.stream(peer), 1 - self._pair_rank(peer)
        comm = self._comms.get(peer)
        if comm is None:  # aborted meanwhile
            raise ChannelBrokenError(f"transfer channel broken: {self.broken or 'aborted'}")
        try:
            with self._watchdog.guard(f"{op} with rank {peer}", None if idle else self.op_timeout_s):
                fn = comm.send if op == "send" else comm.recv
                fn(tensor.data_ptr(), tensor.numel(), self._nccl.NCCL_UINT8, other,
                   stream.cuda_stream)
        except Exception as e:
            self.broken = self.broken or f"{op} with rank {peer}: {type(e).__name__}: {e}"
            self._abort()
            raise

    def async_error(self) -> str | None:
        """A communicator's asynchronous error (a peer gone, a network failure), if any."""
        with self._comms_lock:
            for peer, comm in self._comms.items():
                try:
                    comm.check_async_error()
                except Exception as e:  # noqa: BLE001 - reported as the reason
                    return f"rank {peer}: {type(e).__name__}: {e}"
        return None

    def _why_broken(self) -> str | None:
        """Also a communicator's asynchronous error: a peer gone while this rank waits."""
        if self.broken is None and (error := self.async_error()) is not None:
            self.broken = error
            self._abort()
        return self.broken

    def _expired(self, what: str) -> None:
        """A call or wait outlived its deadline: abort every communicator (their kernels end)."""
        self.broken = self.broken or f"{what} exceeded {self.op_timeout_s:g}s"
        log.error("KV channel %s: %s; aborting its communicators", self.group_name, self.broken)
        self._abort()

    def _abort(self) -> None:
        with self._comms_lock:
            comms, self._comms = self._comms, {}
        for comm in comms.values():
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - already torn down
                pass

    def close(self) -> None:
        """Leave: abort the communicators (peers' operations with this rank fail)."""
        self.broken = self.broken or "closed"
        self._watchdog.close()
        self._abort()

