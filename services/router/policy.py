"""Scoring of candidate workers: pure functions of a load snapshot and the router's promises."""

from __future__ import annotations

from services.router.config import RouterConfig
from services.router.ledger import Pending
from services.router.worker import WorkerLoad


def effective_free_blocks(load: WorkerLoad, pending: Pending) -> int:
    """Free blocks once the router's unreported promises are taken out."""
    return load.free_blocks - pending.blocks


def queue_length(load: WorkerLoad, pending: Pending) -> int:
    """Waiting requests, counting the ones sent but not yet reported."""
    return load.waiting + pending.queued


def decode_score(load: WorkerLoad, pending: Pending, largest_pool: int,
                 config: RouterConfig) -> float:
    """Higher is better: free KV blocks (scaled by the largest candidate's pool,
    so absolute room counts) minus batch occupancy (running + waiting, per batch slot)."""
    free = effective_free_blocks(load, pending) / max(largest_pool, 1)
    busy = (load.running + queue_length(load, pending)) / max(load.max_num_seqs, 1)
    return config.free_weight * free - config.load_weight * busy


def prefill_backlog(load: WorkerLoad, pending: Pending) -> int:
    """Prompt tokens queued on a prefill worker, counting unreported ones."""
    return load.queued_prefill_tokens + pending.tokens


def prefill_cost(load: WorkerLoad, pending: Pending, hit_blocks: int,
                 config: RouterConfig) -> float:
    """Lower is better: the prefill backlog minus credit for prefix-cache hits."""
    credit = config.prefix_weight * hit_blocks * config.block_size
    return prefill_backlog(load, pending) - credit
