"""One channel over several: each peer's messages go over the transport chosen for its pair.

On a GPU cluster a rank may reach some peers over NCCL (other GPUs) and others
through CUDA IPC (the same GPU); the KV protocol sees one ``KVChannel``. The
parts share one ``DeviceSync``; the whole is broken as soon as a part is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tandem.transfer.channel import ChannelBrokenError, KVChannel
from tandem.transfer.device_sync import Event, Stream, wait_until_done


class RoutedChannel:
    """``parts``: a channel per transport, each serving the peers it was built for."""

    def __init__(self, parts: list[KVChannel]) -> None:
        if not parts:
            raise ValueError("a routed channel needs at least one part")
        first = parts[0]
        self.rank, self.world_size, self.sync, self.device = (first.rank, first.world_size,
                                                             first.sync, first.device)
        self.parts = parts
        self._by_peer: Mapping[int, KVChannel] = {p: part for part in parts for p in part.peers}
        self.peers = tuple(sorted(self._by_peer))
        self.op_timeout_s = max(getattr(p, "op_timeout_s", 30.0) for p in parts)

    @property
    def broken(self) -> str | None:
        return next((p.broken for p in self.parts if p.broken is not None), None)

    def _part(self, peer: int) -> KVChannel:
        try:
            return self._by_peer[peer]
        except KeyError:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank}") from None

    def stream(self, peer: int) -> Stream:
        return self._part(peer).stream(peer)

    def send(self, data: torch.Tensor, dst_rank: int) -> None:
        self._part(dst_rank).send(data, dst_rank)

    def recv(self, buf: torch.Tensor, src_rank: int, idle: bool = False) -> None:
        self._part(src_rank).recv(buf, src_rank, idle)

    def wait(self, event: Event, what: str, idle: bool = False) -> None:
        if len(self.parts) == 1:
            self.parts[0].wait(event, what, idle)
            return
        try:
            wait_until_done(self.sync, event, None if idle else self.op_timeout_s,
                            lambda: self.broken, what)
        except TimeoutError as e:
            for part in self.parts:  # out of step: every part is rebuilt with the group
                part.close()
            raise ChannelBrokenError(f"transfer channel broken: {e}") from e
        except ConnectionError as e:
            raise ChannelBrokenError(str(e)) from e

    def close(self) -> None:
        for part in self.parts:
            part.close()
