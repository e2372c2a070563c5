"""The inference engine: requests in, token deltas out, one batched step at a time.

``add_request`` validates and queues; ``step`` schedules, runs one forward pass
and returns an ``EngineOutput`` per sequence that produced a token or finished;
``abort`` stops a request anywhere. The engine knows token ids only: it stops a
sequence on EOS, a stop token id or its length limit; text, stop strings and
what the user sees belong to ``tandem.text.output_processor``. Prefill- and decode-role engines also move
KV in and out: ``export_kv`` / ``release`` on the prefill side, ``reserve`` /
``import_kv`` / ``commit_imported`` on the decode side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from tandem.common.config import EngineConfig, EngineRole
from tandem.common.metrics import WorkerMetrics
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine import host_memory
from tandem.engine.kv_cache.block_pool import BlockPool
from tandem.engine.kv_cache.kv_manager import KVCacheManager, blocks_needed
from tandem.engine.kv_cache.paged_cache import PagedKVCache
from tandem.engine.kv_cache.sizing import num_kv_blocks, working_memory_bytes
from tandem.engine.kernels import cpu_kernels
from tandem.engine.model.config import ModelConfig
from tandem.engine.model.loader import load_model, resolve_dtype
from tandem.engine.model_runner import ModelRunner, SampledToken
from tandem.engine.prefill_rate import PrefillRate
from tandem.engine.sampler import Sampler, TokenLogprob
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.spec.speculator import make_speculator
from tandem.engine.team_cpu import TeamClock
from tandem.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineOutput:
    """What one step did for one request: new tokens, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


class LLMEngine:
    """One model replica on one device, with its paged cache, scheduler and sampler."""

    def __init__(self, config: EngineConfig, *, metrics: WorkerMetrics | None = None) -> None:
        from tandem.engine.model_source import resolve_model

        self.config = config
        self.metrics = metrics
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_path = str(resolve_model(config.model).path)
        self.model_config = ModelConfig.from_dir(self.model_path)
        mc = self.model_config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        # One EOS set for every role: the checkpoint's and the tokenizer's.
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        model = load_model(self.model_path, self.dtype, self.device, self.max_model_len,
                           use_onednn=config.onednn, use_cpu_kernels=config.cpu_kernels,
                           quantization=config.quantization, weight_layout=config.cpu_weight_layout)
        cc = config.cache
        per_block = PagedKVCache.bytes_per_block(mc.num_layers, cc.block_size, mc.num_kv_heads,
                                                 mc.head_dim, self.dtype)
        sc = config.scheduler
        working = working_memory_bytes(mc, sc.max_num_batched_tokens, sc.max_num_seqs, self.dtype)
        if self.device.type == "cpu":  # a step's activations reuse the last step's pages
            host_memory.keep_freed_memory(working)
        num_blocks = num_kv_blocks(cc, per_block, self.device, working)
        self.kv_cache = PagedKVCache(mc.num_layers, num_blocks, cc.block_size, mc.num_kv_heads,
                                     mc.head_dim, self.dtype, self.device)
        self.block_pool = BlockPool(num_blocks, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, KVCacheManager(self.block_pool, cc.block_size))
        sampler = Sampler(config.seed, cpu_kernels.load_for(self.device, config.cpu_kernels))
        self.runner = ModelRunner(model, self.kv_cache, sampler, self.eos_token_ids,
                                  attention=config.attention_backend,
                                  # a prefill-role engine never runs a pure decode step
                                  cuda_graphs=config.cuda_graphs and sc.role != EngineRole.PREFILL,
                                  max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len)
        self.speculator = make_speculator(config, mc, self.scheduler.kv, num_blocks, self.dtype,
                                          self.max_model_len)
        self.num_steps = 0
        self._team_clock = TeamClock()  # the step CPU metric: this thread's and its OpenMP helpers'
        self.prefill_rate = PrefillRate()  # prompt tokens per second of recent steps
        log.info("engine ready: %s %s on %s, %d KV blocks of %d tokens",
                 mc.architecture, self.dtype, self.device, num_blocks, cc.block_size)

    # -- requests -------------------------------------------------------------
    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` if the request can never be served as given."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids
                    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but the model's context is "
                             f"{self.max_model_len} (prompt plus at least one output token)")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and n > sc.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, over max_num_batched_tokens="
                             f"{sc.max_num_batched_tokens} with chunked prefill off")
        if blocks_needed(n + 1, self.config.cache.block_size) > self.block_pool.num_blocks:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds")
        if params.top_k is not None and params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")

    def add_request(self, request_id: str, prompt_token_ids: Seq[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    output_token_ids: Seq[int] = ()) -> None:
        """Validate and queue a request for prefill (local prefill in any role).

        ``output_token_ids``: tokens this request already generated elsewhere (a
        re-drive): they are prefilled with the prompt, count towards ``max_tokens``
        and the penalties, and generation continues at output index ``len(...)``.
        """
        if self.scheduler.get(request_id) is not None:  # reservations included
            raise ValueError(f"request id {request_id!r} is already in use")
        done = list(output_token_ids)
        self.validate(list(prompt_token_ids) + done, params)
        if params.max_tokens is not None and len(done) >= params.max_tokens:
            raise ValueError(f"{len(done)} tokens already generated, max_tokens is {params.max_tokens}")
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       arrival_time=arrival_time or time.monotonic(), output_token_ids=done)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Stop a request wherever it is (reserved included) and free its blocks;
        None if unknown or done. A reservation's KV transfer must be stopped first."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        if self.speculator is not None:
            self.speculator.drop(request_id)
        return self._output(seq, [], [])

    @property
    def _reserved(self) -> dict[str, Sequence]:
        """Reservations awaiting imported KV (owned by the scheduler; read-only view)."""
        return self.scheduler.reserved

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step loop --------------------------------------------------------
    def step(self, on_layer_done: Callable[[int, list[Sequence]], None] | None = None
             ) -> list[EngineOutput]:
        """Run one scheduled forward pass; returns the requests that advanced or ended.

        ``on_layer_done(i, completing)`` runs after layer ``i`` wrote its KV, with
        the sequences whose KV becomes complete in this step (layer-wise transfer).
        """
        mark = self._team_clock.start() if self.metrics is not None else None
        try:
            return self._step(on_layer_done)
        finally:
            if self.metrics is not None:
                self.metrics.step_cpu.inc(self._team_clock.since(mark))
                self.metrics.steps.inc()

    def _step(self, on_layer_done: Callable[[int, list[Sequence]], None] | None
              ) -> list[EngineOutput]:
        spec = self.speculator
        drafts = spec.propose(self.scheduler.running, self.max_model_len) if spec else None
        sched: SchedulerOutput = self.scheduler.schedule(drafts)
        outputs = [self._output(s, [], []) for s in sched.finished]
        if spec is not None:
            for s in sched.finished:
                spec.drop(s.seq_id)
        if not sched.scheduled:
            return outputs
        hook = None
        if on_layer_done is not None:
            completing = [it.seq for it in sched.scheduled if it.samples]
            hook = lambda i: on_layer_done(i, completing)  # noqa: E731
        if self.metrics is not None:
            self._observe_schedule(sched)
        started = time.perf_counter()
        results = self.runner.execute(sched.scheduled, hook)
        self.scheduler.on_step_done(sched)
        # a mixed step's decodes are charged to its prompt tokens: only prefill workers'
        # rates steer the router
        self.prefill_rate.observe(sched.num_prompt_tokens, time.perf_counter() - started,
                                  torch.get_num_threads())
        self.num_steps += 1
        for item, sampled in zip(sched.scheduled, results):
            if sampled is not None:
                outputs.append(self._append_tokens(item.seq, sampled, item.draft_token_ids))
        return outputs

    def _observe_schedule(self, sched: SchedulerOutput) -> None:
        m, now = self.metrics, time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                m.queue_time.observe(now - seq.arrival_time)
        if sched.preempted:
            m.preemptions.inc(len(sched.preempted))

    def update_gauges(self) -> None:
        """Refresh the load gauges (called before a metrics scrape)."""
        if self.metrics is not None:
            m, pool = self.metrics, self.block_pool
            m.running.set(len(self.scheduler.running))
            m.waiting.set(len(self.scheduler.waiting))
            m.kv_usage.set(pool.usage)
            m.free_blocks.set(pool.num_free)

    def _append_token(self, seq: Sequence, sampled: SampledToken) -> EngineOutput:
        return self._append_tokens(seq, [sampled], [])

    def _append_tokens(self, seq: Sequence, sampled: list[SampledToken],
                       draft: list[int]) -> EngineOutput:
        """Commit a step's tokens (one, or accepted drafts + one) up to the first stop.

        With a ``draft``, the KV of accepted draft tokens is kept and the rest
        rolled back (``Scheduler.commit_draft``).
        """
        p = seq.params
        if not seq.output_token_ids and self.metrics is not None and not seq.imported \
                and seq.first_scheduled_time is not None:
            self.metrics.prefill_time.observe(time.monotonic() - seq.first_scheduled_time)
        tokens: list[int] = []
        lps: list[TokenLogprob] = []
        reason = None
        for s in sampled:
            token = s.token_id
            seq.output_token_ids.append(token)
            tokens.append(token)
            if s.logprob is not None:
                lps.append(s.logprob)
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                reason = FinishReason.STOP
            elif (len(seq.output_token_ids) >= (p.max_tokens or 1 << 62)
                  or seq.num_tokens >= self.max_model_len):
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if draft:
            self._observe_draft(seq, len(draft), len(sampled) - 1)
        if self.scheduler.role == EngineRole.PREFILL:
            seq.finish_reason = reason  # the KV is held for export either way; release() frees it
            self.scheduler.hold_prefilled(seq)
        elif reason is not None:
            self.scheduler.finish(seq, reason)
            if self.speculator is not None:
                self.speculator.drop(seq.seq_id)
        elif draft:
            self.scheduler.commit_draft(seq, len(tokens) - 1)
        return self._output(seq, tokens, lps)

    def _observe_draft(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.speculator.observe(seq.seq_id, proposed, accepted)
        if self.metrics is not None:
            m = self.metrics
            m.spec_proposed_tokens.inc(proposed)
            m.spec_accepted_tokens.inc(accepted)
            m.spec_acceptance_length.observe(accepted)

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], lps: list[TokenLogprob]) -> EngineOutput:
        return EngineOutput(seq.seq_id, tokens, seq.is_finished, seq.finish_reason,
                            seq.num_prompt_tokens, len(seq.output_token_ids),
                            seq.num_cached_tokens, lps)

    # -- KV transfer hooks (prefill and decode roles) ----------------------------
    def prefilled_blocks(self, request_id: str) -> list[int]:
        """Prefill role: the block table of a request held after its first token."""
        seq = self.scheduler.prefilled.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not held for export")
        return list(seq.block_ids)

    def export_kv(self, block_ids: Seq[int], layers: range,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather blocks of a layer range into one contiguous tensor (see PagedKVCache)."""
        return self.kv_cache.gather(block_ids, layers, out)

    def hold(self, request_id: str) -> None:
        """Prefill role: stop scheduling a running request but keep its blocks (sends of
        its KV may still read them) until ``release``."""
        seq = self.scheduler.get(request_id)
        if seq is not None and seq.status == SequenceStatus.RUNNING:
            seq.finish_reason = FinishReason.ABORT
            self.scheduler.hold_prefilled(seq)

    def release(self, request_id: str) -> None:
        """Prefill role: free a held request once its KV has been sent (or given up)."""
        seq = self.scheduler.prefilled.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, seq.finish_reason or FinishReason.STOP)

    def reserve(self, request_id: str, prompt_token_ids: Seq[int],
                params: SamplingParams) -> list[int] | None:
        """Decode role: take blocks for a prompt whose KV will be imported; None if full.

        The request is RESERVED (not scheduled) until ``commit_imported``;
        ``cancel_reserved`` or ``abort`` frees it.
        """
        self.validate(prompt_token_ids, params)
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if not self.scheduler.reserve(seq):
            return None
        return list(seq.block_ids)

    def import_kv(self, block_ids: Seq[int], layers: range, data: torch.Tensor) -> None:
        """Scatter received KV ``[L, 2, n, block_size, KVH, D]`` into reserved blocks."""
        self.kv_cache.scatter(block_ids, layers, data)

    def commit_imported(self, request_id: str, first_token: int) -> EngineOutput:
        """Join a reserved request, now holding its prompt's KV, to the decode batch.

        ``first_token`` was sampled by the prefill worker; decoding resumes at token 2.
        """
        seq = self.scheduler.admit_imported(request_id)
        return self._append_token(seq, SampledToken(first_token, None))

    # -- migration between decode workers ----------------------------------------
    def reserve_migration(self, request_id: str, prompt_token_ids: Seq[int],
                          params: SamplingParams, num_tokens: int) -> list[int] | None:
        """Decode role, destination: take blocks for ``num_tokens`` tokens of a request
        moving here with its KV; None if full. Joins the batch by ``commit_migrated``."""
        self.validate(prompt_token_ids, params)
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if not self.scheduler.reserve(seq, num_tokens):
            return None
        return list(seq.block_ids)

    def grow_reservation(self, request_id: str, num_tokens: int) -> list[int] | None:
        """A reservation's block table, grown to hold ``num_tokens`` tokens (a moving
        request decoded on meanwhile); None when the blocks are not free."""
        seq = self.scheduler.reserved[request_id]
        if not self.scheduler.kv.allocate(seq, num_tokens):
            return None
        return list(seq.block_ids)

    def commit_migrated(self, request_id: str, output_token_ids: Seq[int],
                        num_computed_tokens: int) -> bool:
        """Join a reservation holding a moved request's KV to the batch, its outputs so far
        ``output_token_ids``; decoding resumes with the token after them. False when the
        blocks for the next token are not free (the reservation is kept)."""
        return self.scheduler.admit_migrated(request_id, output_token_ids,
                                             num_computed_tokens) is not None

    def pause(self, request_id: str) -> Sequence:
        """Decode role, source: take a request that is decoding out of the batch, its
        blocks kept, for the last copy of its KV; ``resume`` undoes it, ``abort`` frees it.
        Raises ``ValueError`` when it is not between two decode steps."""
        seq = self.scheduler.get(request_id)
        if seq is None or seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
            state = "gone" if seq is None else seq.status.name.lower()
            raise ValueError(f"request {request_id!r} is not decoding ({state})")
        self.scheduler.pause(seq)
        return seq

    def resume(self, request_id: str) -> bool:
        """Put a paused request back into the batch; False when it is not paused."""
        seq = self.scheduler.paused.get(request_id)
        if seq is None:
            return False
        self.scheduler.resume(seq)
        return True

    def cancel_reserved(self, request_id: str) -> bool:
        """Free the blocks of a reservation whose transfer failed or was aborted."""
        return self.scheduler.cancel_reservation(request_id)

    # -- load report (router input) ---------------------------------------------
    def load_snapshot(self) -> dict:
        """Counters the router places requests by. Call on the engine's own thread (the
        engine loop publishes a copy after every step for other threads to read)."""
        sched = self.scheduler
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting)
        queued += sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)
        return dict(total_blocks=self.block_pool.num_blocks, free_blocks=self.block_pool.num_free,
                    block_size=self.config.cache.block_size, running=len(sched.running),
                    waiting=len(sched.waiting), queued_prefill_tokens=queued,
                    max_num_seqs=self.config.scheduler.max_num_seqs,
                    prefill_tokens_per_s=self.prefill_rate.tokens_per_s(torch.get_num_threads()),
                    held=len(sched.prefilled) + len(sched.reserved) + len(sched.paused),
                    request_ids=frozenset(sched.seqs))
