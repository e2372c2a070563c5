"""Draft-model proposer: a small model of the same vocabulary drafts greedily.

The draft keeps its own paged KV cache, addressed by the *target's* block
tables: block ``b`` of a sequence holds the target's KV in the target cache and
the draft's KV for the same positions in the draft cache. So the draft needs no
allocator of its own, and whatever frees or preempts a sequence frees both.

Each step, for the sequences that draft ``k`` tokens: one batched forward catches
the draft's KV up to the sequence's last token and yields ``d_1``, then ``k - 1``
one-token forwards yield ``d_2 .. d_k``. Drafts are the draft's argmax (a point
mass), so verification by resampling (``verifier.py``) stays exact for every
sampling setting. Draft KV past the last committed token is overwritten by the
next catch-up, so rejected drafts need no rollback here.

Where the draft's prompt KV comes from: the draft prefills it itself, on the engine
that decodes (in disaggregated mode the decode worker; nothing extra is shipped
from the prefill worker). The catch-up is bounded: at most ``prefill_chunk`` tokens
a step over all sequences, shortest catch-ups first (those of sequences already
drafting, a few tokens, are outside the budget), so a 2,048-token prompt arriving
costs the running streams many short draft forwards instead of one long one. A sequence whose
draft is still behind decodes without a draft meanwhile.

Why not compute the draft's prompt KV on the prefill worker and ship it with the
target's: moving the draft's KV over gloo is cheap next to computing it
(``tandem bench spec-placement``; figures in services/RESULTS.md, "Speculative
decoding"), but shipping only
moves that computation to the prefill worker, in front of token #1 (TTFT), and
where both workers share the same cores it costs the same CPU either way. Here
it is spread over the decode worker's steps instead: the streams already decoding
when a long prompt arrives see a bounded worst step with chunked catch-up, where an
unbounded catch-up stalls them for the whole draft prefill.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tandem.common.sampling_params import SamplingParams
from tandem.engine.kv_cache.kv_manager import KVCacheManager
from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.engine.kernels import cpu_kernels
from tandem.engine.model.config import ModelConfig
from tandem.engine.model.loader import load_model
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import ScheduledSeq
from tandem.engine.sequence import Sequence

_GREEDY = SamplingParams(temperature=0.0)


class _DraftView:
    """A sequence as the draft runner sees it: its tokens plus the draft so far,
    with the draft's own cursor, on the target's block table."""

    def __init__(self, seq: Sequence, computed: int) -> None:
        self.seq = seq
        self.draft: list[int] = []
        self.num_computed_tokens = computed
        self.block_ids = seq.block_ids
        self.params = _GREEDY
        # the sampler's views (greedy, no penalties: never read for content); the runner reads
        # the prompt's length from num_prompt_tokens
        self.prompt_token_ids: list[int] = []
        self.output_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.draft)

    @property
    def num_prompt_tokens(self) -> int:
        """The target's prompt: the runner attends a chunk of it as a prompt chunk."""
        return self.seq.num_prompt_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        n = self.seq.num_tokens
        head = self.seq.token_slice(start, min(end, n)) if start < n else []
        return head + self.draft[max(start, n) - n:end - n] if end > n else head


def decode_weights(mc: ModelConfig) -> int:
    """Weights one decode step reads: the layers' projections and the LM head (no embedding
    rows beyond the token's, no norms): what a memory-bound step costs in proportion to."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_layer = mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size
    return mc.num_layers * per_layer + mc.vocab_size * mc.hidden_size


class DraftModelProposer:
    """Greedy drafts from a second, smaller checkpoint with the target's vocabulary.

    ``draft_cost``: what one drafted token costs relative to a target decode step,
    estimated from the weights each reads (decode is bound by reading them); the
    adaptive policy charges it per draft token.
    """

    def __init__(self, path: str, target: ModelConfig, kv: KVCacheManager, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, max_model_len: int,
                 use_onednn: bool = True, use_cpu_kernels: bool = True,
                 prefill_chunk: int = 64, max_draft: int = 8, weight_layout: str = "packed") -> None:
        mc = ModelConfig.from_dir(path)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({mc.vocab_size} tokens) differs "
                             f"from the target's ({target.vocab_size})")
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model handles {mc.max_position_embeddings} positions, "
                             f"the target {max_model_len}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        model = load_model(path, dtype, device, max_model_len, use_onednn=use_onednn,
                           use_cpu_kernels=use_cpu_kernels, weight_layout=weight_layout)
        cache = PagedKVCache(mc.num_layers, num_blocks, kv.block_size, mc.num_kv_heads,
                             mc.head_dim, dtype, device)
        self.runner = ModelRunner(model, cache, Sampler(0, cpu_kernels.load_for(device, use_cpu_kernels)), ())
        self.draft_cost = decode_weights(mc) / decode_weights(target)
        self.kv = kv
        self.prefill_chunk = prefill_chunk
        # A drafting sequence lags by at most its last draft plus the target's token:
        # that much is a decode's own work, outside the catch-up budget.
        self.steady_lag = max_draft + 1
        # seq_id -> (positions whose draft KV is valid, the sequence's preemption count then)
        self._computed: dict[str, tuple[int, int]] = {}

    def propose_batch(self, requests: Seq[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Drafts of ``k`` tokens for each ``(sequence, k)`` (decoding sequences only).

        A sequence whose draft KV lags by more than this step's catch-up budget
        gets none: its draft catches up by up to the budget (see the module docstring).
        """
        pending: list[tuple[int, _DraftView, int]] = []
        for seq, k in requests:
            if k <= 0:
                continue
            computed, preemptions = self._computed.get(seq.seq_id, (0, seq.num_preemptions))
            if preemptions != seq.num_preemptions:
                computed = 0  # recomputed on other blocks: the draft KV is gone
            view = _DraftView(seq, min(computed, seq.num_tokens - 1))
            pending.append((view.num_tokens - view.num_computed_tokens, view, k))
        pending.sort(key=lambda p: p[0])
        budget = self.prefill_chunk
        drafting: list[tuple[_DraftView, int]] = []
        first: list[ScheduledSeq] = []
        for behind, view, k in pending:
            cost = behind if behind > self.steady_lag else 0
            if cost > budget:  # catch up part of the way (if any budget is left); no draft
                if budget > 0:
                    first.append(ScheduledSeq(view, budget))
                    budget = 0
            elif self.kv.allocate(view.seq, 1 + k):  # the blocks verification needs; the draft writes first
                first.append(ScheduledSeq(view, behind))
                drafting.append((view, k))
                budget -= cost
        if first:
            self._forward(first)
        for item in first:
            view = item.seq
            self._computed[view.seq.seq_id] = (view.num_computed_tokens, view.seq.num_preemptions)
        active = [(v, k) for v, k in drafting if len(v.draft) < k]
        while active:
            self._forward([ScheduledSeq(v, 1) for v, _ in active])
            active = [(v, k) for v, k in active if len(v.draft) < k]
        return {view.seq.seq_id: view.draft for view, _ in drafting}

    def _forward(self, items: list[ScheduledSeq]) -> None:
        """One batched draft forward; a view whose chunk reaches its end drafts a token."""
        for item, sampled in zip(items, self.runner.execute(items)):
            view = item.seq
            view.num_computed_tokens += item.num_new_tokens
            if sampled is not None:
                view.draft.append(sampled[0].token_id)

    def drop(self, seq_id: str) -> None:
        self._computed.pop(seq_id, None)
