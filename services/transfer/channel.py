"""Point-to-point byte channels between the workers of one transfer group.

``KVChannel`` is the narrow interface the KV protocol speaks: blocking
``send``/``recv`` of contiguous uint8 tensors between ranks. ``CollectiveChannel``
implements it with ``ray.util.collective``: backend ``nccl`` (cupy's NCCL
bindings, CUDA tensors) on GPU clusters and ``gloo`` (torch.distributed gloo,
CPU tensors) as the CPU twin; the same calls either way. One group spans every
prefill and decode worker (a second pairwise gloo group in one process hangs).
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVChannel(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        """Send a contiguous uint8 tensor; returns once the peer has it (or raises)."""
        ...

    def recv(self, buf: torch.Tensor, src_rank: int) -> None:
        """Receive exactly ``buf.numel()`` bytes from ``src_rank`` into ``buf`` (or raise)."""
        ...

    def close(self) -> None: ...


class CollectiveChannel:
    """A rank of a ``ray.util.collective`` group; call from inside a Ray actor."""

    def __init__(self, backend: str, world_size: int, rank: int, group_name: str,
                 timeout_ms: int = 30_000) -> None:
        import ray.util.collective as col

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown transfer backend {backend!r} (gloo or nccl)")
        self._col = col
        self.backend, self.world_size, self.rank = backend, world_size, rank
        self.group_name = group_name
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        if backend == "gloo":
            import torch.distributed as dist

            from services.transfer.store import init_gloo_default_group

            if not dist.is_initialized():  # rendezvous on a store bound to the node address
                init_gloo_default_group(world_size, rank, group_name, timeout_ms)
            col.init_collective_group(world_size, rank, backend="gloo", group_name=group_name,
                                      gloo_timeout=timeout_ms)
        else:
            col.init_collective_group(world_size, rank, backend="nccl", group_name=group_name)

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self._col.send(data, dst_rank, self.group_name)

    def recv(self, buf: torch.Tensor, src_rank: int) -> None:
        self._col.recv(buf, src_rank, self.group_name)

    def close(self) -> None:
        """Leave the group; peers blocked on this rank see their calls fail."""
        try:
            self._col.destroy_collective_group(self.group_name)
        except Exception:  # the group may already be broken by a dead peer
            pass
        if self.backend == "gloo":
            import torch.distributed as dist

            if dist.is_initialized():  # ray's gloo group sits on the default process group
                dist.destroy_process_group()
