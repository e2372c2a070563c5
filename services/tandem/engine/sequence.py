"""A generation request's state as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.common.sampling_params import FinishReason, SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered lifecycle: a sequence only moves forward, except preemption (RUNNING -> WAITING)
    and a migration rolled back (PAUSED -> RUNNING)."""

    WAITING = 0  # queued; holds no blocks (or only prefix-cache hits while being admitted)
    RESERVED = 1  # decode role: blocks held for KV arriving from a prefill worker; not scheduled
    RUNNING = 2  # scheduled each step: prefill chunks, then one decode token per step
    PAUSED = 3  # decode role: out of the batch, KV held while it is copied to another worker
    PREFILLED = 4  # prefill role: token #1 sampled, KV held for export until released
    RELEASED = 5  # finished or aborted: blocks freed (the workers' RELEASED)


@dataclass(eq=False)
class Sequence:
    """Token state and KV block table of one sequence.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the tokens
    past it are computed by the next scheduled step(s).
    """

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the first full blocks
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None  # monotonic; queue time = this - arrival_time
    imported: bool = False  # KV arrived from a prefill worker (decode role)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_id_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.RELEASED
