"""Continuous-batching scheduler (pure Python): chunked prefill, preemption, roles.

Each step gets a token budget. Running sequences go first, decodes before
prefill chunks; then waiting sequences are admitted in arrival order while
budget, sequence slots and blocks last. When a running sequence needs a block
and none is free, the most recently admitted unscheduled sequence is preempted:
its blocks are freed and it is recomputed later (prefix-cache hits make that
cheap). A sequence that alone exceeds the whole cache finishes with ``length``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass, field

from tandem.common.config import EngineRole, SchedulerConfig
from tandem.common.sampling_params import FinishReason
from tandem.engine import batching
from tandem.engine.kv_cache.kv_manager import KVCacheManager, blocks_needed
from tandem.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute ``num_new_tokens`` tokens from its cursor."""

    seq: Sequence
    num_new_tokens: int
    # Speculative tokens computed after the decode token (verified, then kept or rolled back).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        """Positions this step computes: the new tokens plus the draft."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence (its last logits sample)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # out of cache capacity
    # tokens of the scheduled chunks that still had prompt to compute (more than the one
    # token a decode computes), as load_snapshot queues them
    num_prompt_tokens: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


class Scheduler:
    """Decides which tokens of which sequences each step computes."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilled: dict[str, Sequence] = {}  # prefill role: KV held for export
        self.reserved: dict[str, Sequence] = {}  # decode role: blocks awaiting imported KV
        self.paused: dict[str, Sequence] = {}  # decode role: KV being copied to another worker
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence by id
        self.num_preemptions = 0

    # -- queues ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill (validation is the engine's job)."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def reserve(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Decode role: hold blocks for ``num_tokens`` (default: the prompt's) tokens of KV,
        to arrive from a prefill worker (or a decode worker, for a migration).

        The sequence is RESERVED (not scheduled) until :meth:`admit_imported` or
        :meth:`admit_migrated`; :meth:`cancel_reservation` or :meth:`finish` frees it.
        False when the blocks are not free (nothing is held then).
        """
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        if not self.kv.reserve(seq, seq.num_prompt_tokens if num_tokens is None else num_tokens):
            return False
        seq.status = SequenceStatus.RESERVED
        self.seqs[seq.seq_id] = seq
        self.reserved[seq.seq_id] = seq
        return True

    def admit_imported(self, seq_id: str) -> Sequence:
        """Join a RESERVED sequence, whose prompt KV is now in its blocks, to the batch.

        Raises ``KeyError`` when ``seq_id`` holds no reservation.
        """
        seq = self.reserved.pop(seq_id)
        seq.imported = True
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def admit_migrated(self, seq_id: str, output_token_ids: Seq[int],
                       num_computed_tokens: int) -> Sequence | None:
        """Join a RESERVED sequence whose KV arrived from another decode worker to the batch:
        it has generated ``output_token_ids``, the KV of its first ``num_computed_tokens``
        tokens is in its blocks. Blocks past what it needs now go back to the pool. None
        (the reservation kept) when the blocks for its next token are not free."""
        seq = self.reserved[seq_id]
        seq.output_token_ids = list(output_token_ids)
        seq.num_computed_tokens = num_computed_tokens
        if not self.kv.allocate(seq, seq.num_tokens - num_computed_tokens):
            return None
        keep = blocks_needed(seq.num_tokens, self.kv.block_size)
        if len(seq.block_ids) > keep:
            self.kv.pool.free(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]
        del self.reserved[seq_id]
        seq.imported = True
        self.kv.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def pause(self, seq: Sequence) -> None:
        """Decode role: take a RUNNING sequence out of the batch, its blocks kept (their KV
        is being copied out) until :meth:`resume` or :meth:`finish`."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PAUSED
        self.paused[seq.seq_id] = seq

    def resume(self, seq: Sequence) -> None:
        """Back into the batch, where it left off."""
        del self.paused[seq.seq_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def cancel_reservation(self, seq_id: str) -> bool:
        """Free a reservation whose KV will not come; False when there is none."""
        seq = self.reserved.get(seq_id)
        if seq is None:
            return False
        self.finish(seq, FinishReason.ABORT)
        return True

    def get(self, seq_id: str) -> Sequence | None:
        return self.seqs.get(seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Stop a sequence wherever it is and free its blocks."""
        if seq.status == SequenceStatus.RELEASED:
            return
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.RESERVED:
            del self.reserved[seq.seq_id]
        elif seq.status == SequenceStatus.PAUSED:
            del self.paused[seq.seq_id]
        else:
            self.prefilled.pop(seq.seq_id, None)
        self.kv.free(seq)
        seq.status = SequenceStatus.RELEASED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)

    def hold_prefilled(self, seq: Sequence) -> None:
        """Prefill role: keep a sequence's KV after token #1 until it is released."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PREFILLED
        self.prefilled[seq.seq_id] = seq

    # -- one step -------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, Seq[int]] | None = None) -> SchedulerOutput:
        """Pick this step's work; ``drafts`` by sequence id ride on decode tokens.

        A draft is scheduled only while the budget and free blocks allow it
        (it never preempts anything); otherwise its sequence decodes plainly.
        """
        drafts = drafts or {}
        out = SchedulerOutput()
        budget = batching.StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        done: set[str] = set()
        for seq in batching.running_order(self.running, lambda s: s.num_uncomputed_tokens):
            if budget.left == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = budget.share(seq.num_uncomputed_tokens)
            draft = list(drafts.get(seq.seq_id, ()))[:budget.left - 1] if n == 1 else []
            if draft and self.kv.allocate(seq, 1 + len(draft)):
                out.scheduled.append(ScheduledSeq(seq, 1, draft))
                done.add(seq.seq_id)
                budget.spend(1 + len(draft))
            elif self._allocate_or_preempt(seq, n, done, out):
                out.scheduled.append(ScheduledSeq(seq, n))
                if seq.num_uncomputed_tokens > 1:
                    out.num_prompt_tokens += n
                done.add(seq.seq_id)
                budget.spend(n)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _allocate_or_preempt(self, seq: Sequence, n: int, done: set[str],
                             out: SchedulerOutput) -> bool:
        while not self.kv.allocate(seq, n):
            victim = next(s for s in reversed(self.running) if s.seq_id not in done)
            if victim is seq:
                break
            self._preempt(victim, out)
        else:
            return True
        pool = self.kv.pool
        if not out.scheduled and len(seq.block_ids) + pool.num_free == pool.num_blocks:
            self.finish(seq, FinishReason.LENGTH)  # alone and still too big: never fits
            out.finished.append(seq)
        else:
            self._preempt(seq, out)
        return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _admit_waiting(self, out: SchedulerOutput, budget: batching.StepBudget) -> None:
        while self.waiting and budget.admits(len(self.running)):
            seq = self.waiting[0]
            cached = self.kv.match_prefix(seq)
            n = seq.num_uncomputed_tokens
            if n > budget.left and not self.config.enable_chunked_prefill:
                self.kv.free(seq)
                break
            n = budget.share(n)
            if not self.kv.allocate(seq, n):
                self.kv.free(seq)
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            if seq.num_uncomputed_tokens > 1:
                out.num_prompt_tokens += n
            budget.spend(n)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance cursors of the sequences just computed and publish their full blocks."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(item.seq)

    def commit_draft(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: keep the KV of ``num_accepted`` draft tokens, roll back the rest.

        Call once the accepted tokens (and the correction) are in the output:
        the cursor moves past the accepted drafts, whose KV is already in place;
        blocks past what the sequence now needs go back to the pool (they were
        never published to the prefix cache).
        """
        seq.num_computed_tokens += num_accepted
        assert seq.num_computed_tokens < seq.num_tokens, "the correction token is never computed"
        keep = blocks_needed(seq.num_tokens, self.kv.block_size)
        if len(seq.block_ids) > keep:
            self.kv.pool.free(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]
        self.kv.cache_full_blocks(seq)

    @property
    def role(self) -> EngineRole:
        return self.config.role
