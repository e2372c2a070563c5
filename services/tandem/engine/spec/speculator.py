"""Which sequences draft how many tokens this step, and what their drafts are.

Per sequence the acceptance rate ``a`` (the chance one draft token is accepted)
is tracked as an exponential moving average. Drafting ``k`` tokens commits
``1 + a + a^2 + ... + a^k`` tokens in expectation for a step that costs
``1 + c * k`` plain decode steps; the policy drafts the ``k`` that maximises the
ratio (0: do not draft). ``c`` is ``verify_cost`` up to ``_COST_KNEE`` decoding
sequences and grows in proportion to the batch beyond: a step stops being bound
by reading the weights once the batch is large, so every extra position costs
more (``tandem bench spec`` measures the cost per batch size). A proposer that
runs a model adds its own ``draft_cost`` per drafted token (a draft model: the
share of the target's weights it reads; prompt lookup: 0). A sequence with no history drafts one
token to measure itself; one that stops drafting drifts back towards the prior
so it is probed again later.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq

import torch

from tandem.common.config import EngineConfig, EngineRole, SpeculativeConfig
from tandem.engine.kv_cache.kv_manager import KVCacheManager
from tandem.engine.model.config import ModelConfig
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.spec.draft_model import DraftModelProposer
from tandem.engine.spec.proposer import BatchProposer, NgramProposer, Proposer

_PRIOR = 0.5  # acceptance rate assumed for a sequence with no history
_EMA = 0.3  # weight of the newest step in the acceptance average
_DRIFT = 0.05  # per idle step, how far a non-drafting sequence moves back to the prior
_COST_KNEE = 4  # decoding sequences up to which verify_cost holds as configured


class SequenceTokens(Seq[int]):
    """Prompt + output of a sequence as a read-only view (no per-step copy)."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq

    def __len__(self) -> int:
        return self.seq.num_tokens

    def __iter__(self) -> Iterator[int]:
        yield from self.seq.prompt_token_ids
        yield from self.seq.output_token_ids

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return self.seq.token_ids()[i]
            return self.seq.token_slice(start, max(start, stop))
        return self.seq.token_id_at(i if i >= 0 else i + len(self))


def best_k(rate: float, max_k: int, verify_cost: float) -> int:
    """The draft length maximising expected committed tokens per unit of step cost."""
    best, best_value, expected, term = 0, 1.0, 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= rate
        expected += term
        value = expected / (1.0 + verify_cost * k)
        if value > best_value + 1e-12:
            best, best_value = k, value
    return best


class Speculator:
    """Proposes drafts for decoding sequences and learns their acceptance rates."""

    def __init__(self, config: SpeculativeConfig,
                 proposer: Proposer | BatchProposer | None = None) -> None:
        if not config.enabled:
            raise ValueError("speculative decoding is off in this config")
        self.config = config
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        # Cost of one drafted token relative to a target decode step (0 for lookups).
        self.draft_cost = float(getattr(self.proposer, "draft_cost", 0.0))
        self._rate: dict[str, float] = {}
        self.num_proposed = 0  # draft tokens verified, over the engine's life
        self.num_accepted = 0  # of which accepted
        self.num_drafts = 0  # verified drafts

    def draft_length(self, seq_id: str, batch_size: int = 1) -> int:
        """k for this sequence in a step of ``batch_size`` decoding sequences (before
        limits of its length and max_tokens)."""
        c = self.config
        if not c.adaptive:
            return c.num_speculative_tokens
        rate = self._rate.get(seq_id)
        if rate is None:
            return 1  # no history yet: one draft token measures the sequence cheaply
        cost = c.verify_cost * max(1.0, batch_size / _COST_KNEE) + self.draft_cost
        return best_k(rate, c.num_speculative_tokens, cost)

    def propose(self, running: list[Sequence], max_model_len: int) -> dict[str, list[int]]:
        """Drafts by sequence id for the decoding sequences among ``running``.

        A draft leaves room for the target's own token within ``max_tokens`` and
        the context. Nothing is drafted while more than ``max_batch_size``
        sequences decode.
        """
        decoding = [s for s in running if s.status == SequenceStatus.RUNNING
                    and s.num_uncomputed_tokens == 1]
        if len(decoding) > self.config.max_batch_size:
            return {}
        requests: list[tuple[Sequence, int]] = []
        for seq in decoding:
            left = (seq.params.max_tokens or 1 << 62) - len(seq.output_token_ids)
            room = min(left, max_model_len - seq.num_tokens) - 1
            k = min(self.draft_length(seq.seq_id, len(decoding)), room)
            if k <= 0:
                self._drift(seq.seq_id)
            else:
                requests.append((seq, k))
        if isinstance(self.proposer, BatchProposer):
            drafts = self.proposer.propose_batch(requests)
        else:
            drafts = {seq.seq_id: self.proposer.propose(seq.seq_id, SequenceTokens(seq), k)
                      for seq, k in requests}
        return {seq_id: d for seq_id, d in drafts.items() if d}

    def observe(self, seq_id: str, proposed: int, accepted: int) -> None:
        """Record that ``accepted`` of ``proposed`` draft tokens were accepted."""
        if proposed <= 0:
            return
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_drafts += 1
        # An accepted count below the draft length ends at a rejection: a run of
        # accepted tokens then one reject, so the per-token rate is accepted / (accepted + 1);
        # a full match has no rejection in it.
        trials = accepted + (1 if accepted < proposed else 0)
        rate = accepted / trials if trials else _PRIOR
        old = self._rate.get(seq_id, _PRIOR)
        self._rate[seq_id] = old + _EMA * (rate - old)

    def _drift(self, seq_id: str) -> None:
        old = self._rate.get(seq_id)
        if old is not None:
            self._rate[seq_id] = old + _DRIFT * (_PRIOR - old)

    def drop(self, seq_id: str) -> None:
        self._rate.pop(seq_id, None)
        self.proposer.drop(seq_id)


def make_speculator(config: EngineConfig, target: ModelConfig, kv: KVCacheManager,
                    num_blocks: int, dtype: torch.dtype, max_model_len: int) -> Speculator | None:
    """The speculator an engine of ``config`` runs, or None (off, or a prefill-only role)."""
    spec = config.speculative
    if not spec.enabled or config.scheduler.role == EngineRole.PREFILL:
        return None
    proposer = None if spec.method == "ngram" else DraftModelProposer(
        spec.draft_model, target, kv, num_blocks, dtype, torch.device(config.device),
        max_model_len, use_onednn=config.onednn, use_cpu_kernels=config.cpu_kernels,
        prefill_chunk=spec.draft_prefill_chunk, max_draft=spec.num_speculative_tokens,
        weight_layout=config.cpu_weight_layout)
    return Speculator(spec, proposer)
