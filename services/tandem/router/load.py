"""What the router sees of a worker: a handle with a last-reported load snapshot.

The router does no I/O. The cluster layer wraps each Ray actor handle in an
object satisfying :class:`WorkerHandle` and refreshes its :class:`WorkerLoad`
in the background; tests use trivial fakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
ROLES = (PREFILL, DECODE, BOTH)


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load, as last reported.

    ``queued_prefill_tokens`` counts prompt tokens still waiting to be
    prefilled. ``request_ids`` names the requests this snapshot already
    accounts for (running, waiting, or holding reserved blocks): the router
    stops adding its own in-flight promise for a request once the request
    shows up here. A worker that leaves it empty is still routed correctly,
    only more conservatively (promises then last until ``complete``/``release``).
    ``prefill_tokens_per_s`` is the rate its recent steps computed prompt tokens
    at (0.0: none measured yet).
    """

    worker_id: str
    role: str
    alive: bool = True
    total_blocks: int = 0
    free_blocks: int = 0
    block_size: int = 16
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    max_num_seqs: int = 256
    request_ids: frozenset[str] = frozenset()
    prefill_tokens_per_s: float = 0.0


@runtime_checkable
class WorkerHandle(Protocol):
    """A worker as the router sees it.

    ``role`` is ``"prefill"``, ``"decode"`` or ``"both"`` (``EngineRole``'s
    values compare equal). ``load()`` returns the last reported snapshot and
    must not block.
    """

    @property
    def worker_id(self) -> str:
        """Stable id of the worker, unique in the cluster."""
        ...

    @property
    def role(self) -> str:
        """``"prefill"``, ``"decode"`` or ``"both"``."""
        ...

    def load(self) -> WorkerLoad:
        """The last load snapshot (cheap, non-blocking)."""
        ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks needed to hold ``num_tokens`` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-num_tokens // block_size)
