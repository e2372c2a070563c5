"""Scoring of candidate workers: pure functions of a load snapshot and the router's promises."""

from __future__ import annotations

from tandem.router.config import RouterConfig
from tandem.router.ledger import Pending
from tandem.router.load import WorkerLoad


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


def prefill_saturated(load: WorkerLoad, pending: Pending, config: RouterConfig) -> bool:
    """Whether a prompt sent there would wait longer than ``prefill_saturation_s`` for its
    turn (the backlog at the worker's measured rate), or, before the worker measured one,
    whether its backlog exceeds ``prefill_saturation_tokens``."""
    backlog = prefill_backlog(load, pending)
    if load.prefill_tokens_per_s > 0.0:
        return backlog > config.prefill_saturation_s * load.prefill_tokens_per_s
    return backlog > config.prefill_saturation_tokens


def prefill_cost(load: WorkerLoad, pending: Pending, prompt_tokens: int, hit_blocks: int,
                 config: RouterConfig, timed: bool) -> float:
    """Lower is better: the prompt tokens the worker computes before this prompt's first
    token (its backlog, then the prompt less credit for prefix-cache hits), or with
    ``timed`` (every candidate measured its rate) the seconds they take at its rate."""
    credit = config.prefix_weight * hit_blocks * config.block_size
    work = prefill_backlog(load, pending) + max(0.0, prompt_tokens - credit)
    return work / load.prefill_tokens_per_s if timed else work
