"""Point-to-point byte channels between the workers of one transfer group.

``KVChannel`` is the narrow interface the KV protocol speaks: blocking
``send``/``recv`` of contiguous uint8 tensors between ranks, each bounded by
the channel's operation deadline (``op_timeout_s``) except a receive marked
``idle`` (waiting for the next message from a peer that may have nothing to
send for hours). A channel that failed or timed out once is ``broken`` for good:
the stream is out of step, so the worker reports not-alive and the cluster
rebuilds the group.

``CollectiveChannel`` implements it with ``ray.util.collective``: backend
``nccl`` (cupy's NCCL bindings, CUDA tensors) on GPU clusters and ``gloo``
(torch.distributed gloo, CPU tensors) as the CPU twin. Ray's gloo group sits
on torch's default process group, created without a timeout (torch's 30-minute
default), and its send/recv take none; so gloo calls go to torch.distributed
directly, as ``isend``/``irecv`` whose ``wait(timeout)`` bounds each one (a
gloo timeout closes the pair: the channel is then broken). NCCL calls cannot
time out: a :class:`~services.transfer.watchdog.Watchdog` tears the group down
when one outlives its deadline. One group spans every prefill and decode
worker (a second pairwise gloo group in one process hangs).
"""

from __future__ import annotations

import datetime
import logging
from typing import Protocol

import torch

from services.transfer.watchdog import Watchdog

log = logging.getLogger(__name__)
IDLE_WAIT = datetime.timedelta(days=3650)  # an idle peer is not a failure


class ChannelBrokenError(ConnectionError):
    """The channel failed or timed out earlier; the group must be rebuilt."""


class KVChannel(Protocol):
    rank: int
    world_size: int
    device: torch.device
    broken: str | None  # why the channel is unusable; None while healthy

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        """Send a contiguous uint8 tensor; returns once the peer has it (or raises,
        at the latest after the channel's deadline)."""
        ...

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        """Receive exactly ``buf.numel()`` bytes from ``src_rank`` into ``buf`` (or raise);
        bounded by the channel's deadline unless ``idle`` (the wait for a next message)."""
        ...

    def close(self) -> None: ...


class CollectiveChannel:
    """A rank of a ``ray.util.collective`` group; call from inside a Ray actor."""

    def __init__(self, backend: str, world_size: int, rank: int, group_name: str,
                 timeout_ms: int = 30_000, op_timeout_s: float = 30.0) -> None:
        import ray.util.collective as col

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown transfer backend {backend!r} (gloo or nccl)")
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self._col = col
        self.backend, self.world_size, self.rank = backend, world_size, rank
        self.group_name = group_name
        self.op_timeout_s = op_timeout_s
        self.broken: str | None = None
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self._watchdog: Watchdog | None = None
        if backend == "gloo":
            import torch.distributed as dist

            from services.transfer.store import init_gloo_default_group

            if not dist.is_initialized():  # rendezvous on a store bound to the node address
                init_gloo_default_group(world_size, rank, group_name, timeout_ms)
            col.init_collective_group(world_size, rank, backend="gloo", group_name=group_name,
                                      gloo_timeout=timeout_ms)
        else:
            col.init_collective_group(world_size, rank, backend="nccl", group_name=group_name)
            self._watchdog = Watchdog(self._expired)

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self._call("send", data, dst_rank, False)

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self._call("recv", buf, src_rank, idle)

    def _call(self, op: str, tensor: torch.Tensor, peer: int, idle: bool) -> None:
        if self.broken is not None:
            raise ChannelBrokenError(f"transfer channel broken: {self.broken}")
        try:
            if self.backend == "gloo":
                import torch.distributed as dist

                work = (dist.isend if op == "send" else dist.irecv)(tensor, peer)
                work.wait(timeout=IDLE_WAIT if idle else
                          datetime.timedelta(seconds=self.op_timeout_s))
            else:
                with self._watchdog.guard(f"{op} with rank {peer}",
                                          None if idle else self.op_timeout_s):
                    (self._col.send if op == "send" else self._col.recv)(
                        tensor, peer, self.group_name)
        except Exception as e:
            self.broken = self.broken or f"{op} with rank {peer}: {type(e).__name__}: {e}"
            raise

    def _expired(self, what: str) -> None:
        """Watchdog: an NCCL call outlived its deadline; tear the group down (it fails)."""
        self.broken = f"{what} exceeded {self.op_timeout_s:g}s"
        log.error("KV channel %s: %s; aborting the group", self.group_name, self.broken)
        self._destroy()

    def close(self) -> None:
        """Leave the group; peers blocked on this rank see their calls fail."""
        self.broken = self.broken or "closed"
        if self._watchdog is not None:
            self._watchdog.close()
        self._destroy()

    def _destroy(self) -> None:
        try:
            self._col.destroy_collective_group(self.group_name)
        except Exception:  # the group may already be broken by a dead peer
            pass
        if self.backend == "gloo":
            import torch.distributed as dist

            if dist.is_initialized():  # ray's gloo group sits on the default process group
                dist.destroy_process_group()
