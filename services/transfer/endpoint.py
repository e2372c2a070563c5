"""A worker's end of the KV transfer group: compatibility handshake, channel, sender/receiver."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from services.engine.engine import LLMEngine
from services.protocol.messages import CompatibilityDescriptor
from services.transfer.channel import CollectiveChannel, KVChannel
from services.transfer.layout import MIN_RUN_PLANE_BYTES
from services.transfer.receiver import KVReceiver
from services.transfer.sender import KVSender, SendReport


def compatibility(engine: LLMEngine) -> CompatibilityDescriptor:
    """What a peer's KV layout must match for blocks to be copied byte for byte."""
    mc, cache = engine.model_config, engine.kv_cache
    return CompatibilityDescriptor(
        model_id=f"{mc.architecture}:{_config_digest(engine.model_path)}", dtype=str(engine.dtype).removeprefix("torch."),
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        block_size=cache.block_size, layout_version=cache.LAYOUT_VERSION)


def open_channel(backend: str, world_size: int, rank: int, group_name: str,
                 timeout_ms: int, op_timeout_s: float) -> KVChannel:
    """Join the group (rendezvous within ``timeout_ms``); each send/recv is bounded
    by ``op_timeout_s``."""
    return CollectiveChannel(backend, world_size, rank, group_name, timeout_ms, op_timeout_s)


def make_sender(channel: KVChannel, engine: LLMEngine, on_done: Callable[[SendReport], None],
                min_run_plane_bytes: int | None = MIN_RUN_PLANE_BYTES) -> KVSender:
    cache = engine.kv_cache
    return KVSender(channel, cache.gather, cache.block_shape, cache.dtype, on_done,
                    cache.plane, cache.plane_block_bytes, min_run_plane_bytes)


def make_receiver(channel: KVChannel, engine: LLMEngine, peers: Sequence[int]) -> KVReceiver:
    cache = engine.kv_cache
    return KVReceiver(channel, peers, cache.scatter, cache.block_shape, cache.dtype,
                      cache.plane, cache.plane_block_bytes)


def _config_digest(model_path: str) -> str:
    """Same checkpoint config wherever it is mounted."""
    return hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()[:16]
