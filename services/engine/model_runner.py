"""Turns a scheduled step into one batched forward pass and samples the rows that finish.

All tokens of the step go through the model as one flat batch ``[T]``. For
attention, decodes (one query each) form one group and prefill chunks another,
each padded only to its own longest query. The LM head runs only on sampling
rows: the last token of each finishing prefill chunk and every decode row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.engine.kv_cache.paged_cache import PagedKVCache
from services.engine.model.attention import AttentionGroup, AttentionMetadata
from services.engine.model.llama import LlamaModel
from services.engine.sampler import Sampler, SamplingBatch, TokenLogprob
from services.engine.scheduler import ScheduledSeq


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler on one device."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, sampler: Sampler,
                 eos_token_ids: Sequence[int]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.sliding_window = model.config.sliding_window

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq],
                on_layer_done: Callable[[int], None] | None = None) -> list[SampledToken | None]:
        """Run one step; returns, per entry of ``scheduled``, its sampled token or None."""
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_new_tokens > 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_items: list[int] = []
        decodes, prefills = [], []
        for i in order:
            item = scheduled[i]
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            (decodes if n == 1 else prefills).append((len(ids), start, n, seq.block_ids))
            ids.extend(seq.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            bs, blocks = self.block_size, seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.samples:
                sample_rows.append(len(ids) - 1)
                sample_items.append(i)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            groups=[g for g in (self._group(decodes), self._group(prefills)) if g is not None])
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            self.kv_cache.kv, meta, on_layer_done)
        results: list[SampledToken | None] = [None] * len(scheduled)
        if not sample_rows:
            return results
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden[rows])  # [R, V]
        for i, tok in zip(sample_items, self._sample(logits, [scheduled[i] for i in sample_items])):
            results[i] = tok
        return results

    def _sample(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[SampledToken]:
        seqs = [it.seq for it in items]
        banned = [self._banned(s) for s in seqs]
        simple = all(s.params.greedy and s.params.logprobs is None and not s.params.uses_penalties
                     for s in seqs) and not any(banned)
        if simple:
            return [SampledToken(t, None) for t in logits.argmax(dim=-1).tolist()]
        batch = SamplingBatch(
            params=[s.params for s in seqs], prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs], banned_token_ids=banned)
        out = self.sampler(logits, batch)
        return [SampledToken(t, lp) for t, lp in zip(out.token_ids, out.logprobs)]

    def _banned(self, seq) -> tuple[int, ...]:
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens:
            return ()
        return p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)

    def _group(self, entries: list[tuple[int, int, int, list[int]]]) -> AttentionGroup | None:
        """Pad ``(flat offset, cursor, n new, block ids)`` entries into one attention group."""
        if not entries:
            return None
        dev, bs = self.device, self.block_size
        b = len(entries)
        q_len = max(e[2] for e in entries)
        max_blocks = max(-(-(e[1] + e[2]) // bs) for e in entries)
        table = torch.zeros(b, max_blocks, dtype=torch.long)
        for r, e in enumerate(entries):
            nb = -(-(e[1] + e[2]) // bs)
            table[r, :nb] = torch.tensor(e[3][:nb])
        offsets = torch.tensor([e[0] for e in entries])  # [B]
        starts = torch.tensor([e[1] for e in entries])
        lens = torch.tensor([e[2] for e in entries])
        i = torch.arange(q_len)
        valid = i[None, :] < lens[:, None]  # [B, Q]
        token_index = torch.where(valid, offsets[:, None] + i[None, :], 0)
        q_pos = starts[:, None] + torch.minimum(i[None, :], lens[:, None] - 1)  # [B, Q]
        k_pos = torch.arange(max_blocks * bs)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, K]
        if self.sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        all_valid = bool(valid.all())
        return AttentionGroup(
            token_index=token_index.to(dev),
            valid_flat=None if all_valid else valid.flatten().nonzero().squeeze(1).to(dev),
            token_rows=token_index[valid].to(dev),
            block_table=table.to(dev),
            last_pos=(starts + lens - 1).to(dev),
            mask=mask.unsqueeze(1).to(dev))
