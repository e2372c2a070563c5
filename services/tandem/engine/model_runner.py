"""Turns a scheduled step into one batched forward pass and samples the rows that finish.

All tokens of the step go through the model as one flat batch ``[T]``. For
attention, decodes (one query each) form one group, speculating decodes (the
decode token plus its draft, ``k + 1`` queries) another and prefill chunks a
third, each padded only to its own longest query. The LM head runs only on
sampling rows: the last token of each finishing prefill chunk, every decode row
and every position of a speculating decode, which are verified against the
draft (``spec/verifier.py``).

With a backend that reads blocks in place (``uses_varlen``: the Triton kernels
on CUDA) the step is one varlen batch instead of groups, its inputs reach the
device in one copy (``varlen_inputs.py``), the layer's elementwise steps are
fused Triton kernels (``model/triton_layer_ops.py``), pure decode steps replay
CUDA graphs (``decode_graphs.py``), and the one sync is reading the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.engine.attention_groups import build_group, same_shape
from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.engine.decode_graphs import DecodeGraphs
from tandem.engine.model.attention import AttentionMetadata
from tandem.engine.model.llama import LlamaModel
from tandem.engine.model.triton_attention import select_attention
from tandem.engine.sampler import Sampler, SamplingBatch, TokenLogprob
from tandem.engine.scheduler import ScheduledSeq
from tandem.engine.sequence import Sequence as EngineSequence
from tandem.engine.spec.verifier import DraftPrefix, accepted_length
from tandem.engine.varlen_inputs import Entry, StepTensors, VarlenInputs


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


@dataclass
class _Row:
    """One sampling row: entry ``item`` of the step, at its output plus ``draft``."""

    item: int
    seq: EngineSequence
    draft: Sequence[int]


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler on one device.

    ``attention``: ``auto`` (Triton on CUDA, torch elsewhere), ``torch`` or
    ``triton``. ``cuda_graphs``: replay pure decode steps of up to
    ``max_num_seqs`` sequences as graphs (needs a varlen backend; captured on
    CUDA, run eagerly with the same padding elsewhere); ``max_model_len`` sets
    the graphs' block-table width.
    """

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, sampler: Sampler,
                 eos_token_ids: Sequence[int], *, attention: str = "auto",
                 cuda_graphs: bool = False, max_num_seqs: int = 256,
                 max_model_len: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.sliding_window = model.config.sliding_window
        cfg = model.config
        model.attn = select_attention(attention, self.device, model.attn, cfg.head_dim ** -0.5,
                                      cfg.sliding_window)
        self.varlen = model.attn.uses_varlen
        if self.varlen:  # the Triton path: the elementwise steps fused too
            from tandem.engine.model.triton_layer_ops import TritonLayerOps

            model.ops = TritonLayerOps()
        self.inputs = VarlenInputs(self.device, self.block_size) if self.varlen else None
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.inputs is not None:
            positions = max_model_len or cfg.max_position_embeddings
            self.graphs = DecodeGraphs(self._graph_forward, self.inputs, max_num_seqs,
                                       -(-positions // self.block_size))
            with torch.inference_mode():
                self.graphs.capture_all()

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq],
                on_layer_done: Callable[[int], None] | None = None
                ) -> list[list[SampledToken] | None]:
        """Run one step; returns, per entry of ``scheduled``, the tokens it commits or None.

        A plain sampling entry commits one token; a speculating one commits its
        accepted draft tokens and then the target's own token (1 to k + 1).
        """
        # Attention groups: 0 decodes, 1 speculating decodes, 2 prefill chunks (a prompt's
        # chunk of one token too: prompt rows take the prompt kernels whatever their chunk)
        kind = [1 if it.draft_token_ids else
                0 if it.num_new_tokens == 1 and it.seq.num_computed_tokens >= it.seq.num_prompt_tokens
                else 2 for it in scheduled]
        order = sorted(range(len(scheduled)), key=kind.__getitem__)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        rows: list[_Row] = []
        groups: tuple[list, list, list] = ([], [], [])
        entries: list[Entry] = []  # every item in flat order (varlen)
        for i in order:
            item = scheduled[i]
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_scheduled_tokens
            entries.append((len(ids), start, n, seq.block_ids))
            groups[kind[i]].append(entries[-1])
            ids.extend(seq.token_slice(start, start + item.num_new_tokens))
            ids.extend(item.draft_token_ids)
            positions.extend(range(start, start + n))
            bs, blocks = self.block_size, seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.draft_token_ids:
                first = len(ids) - n
                for j in range(n):
                    sample_rows.append(first + j)
                    rows.append(_Row(i, seq, item.draft_token_ids[:j]))
            elif item.samples:
                sample_rows.append(len(ids) - 1)
                rows.append(_Row(i, seq, ()))
        results: list[list[SampledToken] | None] = [None] * len(scheduled)
        if self.varlen:
            logits = self._varlen_logits(entries, ids, positions, slots, sample_rows,
                                         on_layer_done)
        else:
            logits = self._group_logits(groups, ids, positions, slots, sample_rows, on_layer_done)
        if logits is None:
            return results
        for row, tok in zip(rows, self._sample(logits, rows)):
            out = results[row.item]
            if out is None:
                results[row.item] = [tok]
            else:
                out.append(tok)
        for i, item in enumerate(scheduled):
            if item.draft_token_ids:
                samples = results[i]
                n = accepted_length([t.token_id for t in samples], item.draft_token_ids)
                results[i] = samples[:n]
        return results

    def _group_logits(self, groups: tuple[list, list, list], ids: list[int],
                      positions: list[int], slots: list[int], sample_rows: list[int],
                      on_layer_done: Callable[[int], None] | None) -> torch.Tensor | None:
        """The torch backend's step: padded attention groups; logits ``[R, V]`` or None."""
        dev = self.device
        decodes, speculating, chunks = groups
        stack = self.model.decode_stack
        if stack is not None and not speculating and not chunks and on_layer_done is None \
                and len(ids) <= stack.max_rows:  # a pure decode step: one native call
            hidden = stack.run(ids, positions, slots, [e[3] for e in decodes], self.kv_cache.kv)
        else:
            flat = torch.tensor([ids, positions, slots], dtype=torch.long).to(dev)  # [3, T]
            meta = AttentionMetadata(
                slot_mapping=flat[2],
                groups=[g for g in (build_group(e, self.block_size, self.sliding_window, dev, prompt)
                                    for e, prompt in [(decodes, False), (speculating, False),
                                                      *((c, True) for c in same_shape(chunks))])
                        if g is not None])
            hidden = self.model(flat[0], flat[1], self.kv_cache.kv, meta, on_layer_done)
        if not sample_rows:
            return None
        if len(sample_rows) < len(ids):  # (distinct and increasing: as many means every row)
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        return self.model.compute_logits(hidden)  # [R, V]

    def _varlen_logits(self, entries: list[Entry], ids: list[int], positions: list[int],
                       slots: list[int], sample_rows: list[int],
                       on_layer_done: Callable[[int], None] | None) -> torch.Tensor | None:
        """A varlen backend's step: a graph replay for a pure decode step, else one eager
        pass over inputs copied in once; logits ``[R, V]`` or None."""
        g = self.graphs
        if g is not None and on_layer_done is None and len(ids) == len(entries) \
                and len(sample_rows) == len(ids) and len(entries) <= g.max_batch:
            return g.run(entries, ids, positions, slots)
        max_query_len = max((e[2] for e in entries), default=0)
        step = self.inputs.build(entries, ids, positions, slots, sample_rows, max_query_len)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache.kv, step.meta,
                            on_layer_done)
        if not sample_rows:
            return None
        return self.model.compute_logits(hidden[step.sample_index])

    def _graph_forward(self, step: StepTensors) -> torch.Tensor:
        """A decode step on static tensors, every row sampling: logits ``[bucket, V]``."""
        hidden = self.model(step.input_ids, step.positions, self.kv_cache.kv, step.meta)
        return self.model.compute_logits(hidden[step.sample_index])

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[SampledToken]:
        """One token per row of ``logits`` [R, V], each row sampled as a plain decode
        step would sample it after its sequence's output plus the row's draft prefix."""
        seqs = [r.seq for r in rows]
        outputs = [DraftPrefix(r.seq.output_token_ids, r.draft) if r.draft else
                   r.seq.output_token_ids for r in rows]
        banned = [self._banned(s, len(o)) for s, o in zip(seqs, outputs)]
        simple = all(s.params.greedy and s.params.logprobs is None and not s.params.uses_penalties
                     and not s.params.logit_bias for s in seqs) and not any(banned)
        if simple:
            return [SampledToken(t, None) for t in self.sampler.argmax(logits).tolist()]
        batch = SamplingBatch(
            params=[s.params for s in seqs], prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=outputs, banned_token_ids=banned)
        out = self.sampler(logits, batch)
        return [SampledToken(t, lp) for t, lp in zip(out.token_ids, out.logprobs)]

    def _banned(self, seq: EngineSequence, num_output: int) -> tuple[int, ...]:
        p = seq.params
        if num_output >= p.min_tokens:
            return ()
        return p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
