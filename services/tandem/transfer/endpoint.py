"""A worker's end of the KV transfer group: compatibility handshake, channel, sender/receiver.

``open_channel`` builds a worker's channel inside Ray; ``open_pair_channel``,
``cache_sender`` and ``cache_receiver`` build a sender/receiver pair over two
processes without Ray (the device check), on top of a plain ``PagedKVCache``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.protocol.messages import CompatibilityDescriptor
from tandem.transfer.channel import CollectiveChannel, KVChannel
from tandem.transfer.layout import MIN_RUN_PLANE_BYTES
from tandem.transfer.placement import GLOO, IPC, NCCL
from tandem.transfer.receiver import KVReceiver
from tandem.transfer.rendezvous import FileRendezvous, RayRendezvous, Rendezvous
from tandem.transfer.routed import RoutedChannel
from tandem.transfer.sender import HEARTBEAT_S, KVSender, SendReport
from tandem.transfer.device_sync import DeviceSync, make_sync


def compatibility(engine: LLMEngine) -> CompatibilityDescriptor:
    """What a peer's KV layout must match for blocks to be copied byte for byte."""
    mc, cache = engine.model_config, engine.kv_cache
    return CompatibilityDescriptor(
        model_id=f"{mc.architecture}:{_config_digest(engine.model_path)}", dtype=str(engine.dtype).removeprefix("torch."),
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        block_size=cache.block_size, layout_version=cache.LAYOUT_VERSION)


def open_channel(transports: Mapping[int, str], world_size: int, rank: int, group_name: str,
                 sync: DeviceSync, senders: Sequence[int] = (), timeout_ms: int = 30_000,
                 op_timeout_s: float = 30.0, rendezvous: Rendezvous | None = None,
                 optional: Sequence[int] = ()) -> KVChannel:
    """Join the group (every pair connected within ``timeout_ms``) inside a Ray actor.

    ``transports``: peer rank -> ``gloo`` | ``nccl`` | ``ipc`` (``placement.pair_transports``);
    ``senders``: the peers that open a pair with this rank as its sender (those it
    receives prompts' KV from, and for a pair of decode workers the lower rank).
    ``optional``: peers whose loss does not break the channel (gloo; on GPU any lost
    pair breaks it). Each send/recv and each wait for one is bounded by ``op_timeout_s``.
    """
    kinds = set(transports.values())
    if kinds == {GLOO}:
        return CollectiveChannel(world_size, rank, group_name, list(transports), timeout_ms,
                                 op_timeout_s, optional)
    if GLOO in kinds or not kinds <= {NCCL, IPC}:
        raise ValueError(f"cannot mix transports {sorted(kinds)} in one group")
    rendezvous = rendezvous or RayRendezvous(f"tandem-kv-{group_name}-")
    parts: list[KVChannel] = []
    for kind in (NCCL, IPC):  # every rank in the same order: NCCL pairs first, then IPC
        peers = [p for p, k in transports.items() if k == kind]
        if peers:
            parts.append(_open_part(kind, rank, world_size, peers, group_name, sync, rendezvous,
                                    senders, timeout_ms, op_timeout_s))
    return parts[0] if len(parts) == 1 else RoutedChannel(parts)


def _open_part(kind: str, rank: int, world_size: int, peers: Sequence[int], group_name: str,
               sync: DeviceSync, rendezvous: Rendezvous, senders: Sequence[int],
               timeout_ms: int, op_timeout_s: float) -> KVChannel:
    if kind == NCCL:
        from tandem.transfer.nccl_channel import NcclChannel

        return NcclChannel(rank, world_size, peers, group_name, sync, rendezvous, timeout_ms,
                           op_timeout_s, senders)
    from tandem.transfer.ipc_channel import IpcChannel

    return IpcChannel.connect(rank, world_size, peers, group_name, sync, rendezvous, timeout_ms,
                              op_timeout_s, senders)


def open_pair_channel(kind: str, rank: int, device: str | torch.device,
                      rendezvous_dir: str | Path, group_name: str = "tandem-pair",
                      timeout_ms: int = 60_000, op_timeout_s: float = 30.0) -> KVChannel:
    """One end of a two-process KV pair without Ray: rank 0 sends (prefill), rank 1
    receives (decode); both processes call it at once with the same ``rendezvous_dir``
    (a private directory) and ``group_name``.

    ``kind``: ``nccl`` (two GPUs), ``ipc`` (one GPU) or ``auto`` (``ipc`` when both ranks
    report the same device UUID, else ``nccl``). ``device``: this process's GPU; ``cpu``
    runs the ``ipc`` path over shared host memory (a dry run of the plumbing).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rendezvous = FileRendezvous(rendezvous_dir)
    peer = 1 - rank
    if device.type == "cpu":
        if kind not in ("auto", IPC):
            raise ValueError(f"on CPU only the ipc path runs (a dry run), got kind {kind!r}")
        kind = IPC
    elif kind == "auto":
        mine = str(torch.cuda.get_device_properties(device).uuid)
        rendezvous.put(f"{group_name}-uuid-{rank}", mine.encode())
        theirs = rendezvous.get(f"{group_name}-uuid-{peer}", timeout_ms / 1000).decode()
        kind = IPC if mine == theirs else NCCL
    if kind not in (NCCL, IPC):
        raise ValueError(f"kind must be nccl, ipc or auto, got {kind!r}")
    return _open_part(kind, rank, 2, [peer], group_name, make_sync(device), rendezvous,
                      [0] if rank == 1 else [], timeout_ms, op_timeout_s)


def cache_sender(channel: KVChannel, cache: PagedKVCache, on_done: Callable[[SendReport], None],
                 min_run_plane_bytes: int | None = MIN_RUN_PLANE_BYTES,
                 receivers: Sequence[int] | None = None,
                 heartbeat_s: float | None = HEARTBEAT_S) -> KVSender:
    """The sending end over ``channel`` (to ``receivers``, default every peer), reading
    blocks of ``cache``; ``heartbeat_s`` None: no heartbeats."""
    return KVSender(channel, cache.gather, cache.block_shape, cache.dtype, on_done,
                    cache.plane, cache.plane_block_bytes, min_run_plane_bytes,
                    heartbeat_s=heartbeat_s, receivers=receivers)


def cache_receiver(channel: KVChannel, cache: PagedKVCache, peers: Sequence[int],
                   on_demand: Sequence[int] = ()) -> KVReceiver:
    """The decode end over ``channel``, writing into reserved blocks of ``cache``."""
    return KVReceiver(channel, peers, cache.scatter, cache.block_shape, cache.dtype,
                      cache.plane, cache.plane_block_bytes, on_demand)


def make_sender(channel: KVChannel, engine: LLMEngine, on_done: Callable[[SendReport], None],
                min_run_plane_bytes: int | None = MIN_RUN_PLANE_BYTES,
                receivers: Sequence[int] | None = None,
                heartbeat_s: float | None = HEARTBEAT_S) -> KVSender:
    return cache_sender(channel, engine.kv_cache, on_done, min_run_plane_bytes, receivers,
                        heartbeat_s)


def make_receiver(channel: KVChannel, engine: LLMEngine, peers: Sequence[int],
                  on_demand: Sequence[int] = ()) -> KVReceiver:
    return cache_receiver(channel, engine.kv_cache, peers, on_demand)


def _config_digest(model_path: str) -> str:
    """Same checkpoint config wherever it is mounted."""
    return hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()[:16]
