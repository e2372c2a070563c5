"""Offline batch generation in the shape vLLM users know: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from services.common.config import CacheConfig, EngineConfig, SchedulerConfig
from services.common.sampling_params import FinishReason, SamplingParams
from services.engine.engine import LLMEngine
from services.engine.sampler import TokenLogprob

Prompt = str | Seq[int]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """A prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    """An engine plus its tokenizer, for offline use.

    ``model=None`` serves the embedded default checkpoint (written on first use).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "cpu",
                 seed: int = 0, max_model_len: int | None = None, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory_gb: float = 1.0,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 num_threads: int | None = None, onednn: bool = True,
                 cpu_kernels: bool = True) -> None:
        config = EngineConfig(
            model=model, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len,
            num_threads=num_threads, onednn=onednn, cpu_kernels=cpu_kernels,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              memory_gb=kv_cache_memory_gb,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill))
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); results in order.

        Every prompt is validated before any is queued, so a bad one raises
        ``ValueError`` and leaves nothing half-started.
        """
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) \
            else list(params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        requests = []
        for prompt, p in zip(prompt_list, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.validate(ids, p)
            requests.append((prompt if isinstance(prompt, str) else None, ids, p))
        return self._run(requests)

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation, then generate.

        Special-token text inside a message is tokenized as plain text (see
        :meth:`Tokenizer.encode_chat`).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.encode_chat(list(c), add_generation_prompt=True) for c in conversations]
        return self.generate(ids, sampling_params)

    def _run(self, requests: list[tuple[str | None, list[int], SamplingParams]]
             ) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        where: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        queue = []
        for prompt, ids, p in requests:
            req = RequestOutput(str(next(self._ids)), prompt, ids)
            results.append(req)
            for i in range(p.n):
                sub = p if p.n == 1 else dataclasses.replace(
                    p, n=1, seed=None if p.seed is None else (p.seed + i) % 2**63)
                rid = f"{req.request_id}-{i}"
                comp = CompletionOutput(i, "", [], None, [] if p.logprobs is not None else None)
                req.outputs.append(comp)
                where[rid] = (req, comp)
                queue.append((rid, ids, sub))
        try:
            for rid, ids, sub in queue:
                self.engine.add_request(rid, ids, sub)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    req, comp = where[out.request_id]
                    comp.token_ids.extend(out.new_token_ids)
                    comp.text += out.new_text
                    if comp.logprobs is not None:
                        comp.logprobs.extend(out.new_logprobs)
                    if out.finished:
                        comp.finish_reason = out.finish_reason
                        req.num_cached_tokens = out.num_cached_tokens
        finally:
            for rid, (_, comp) in where.items():
                if comp.finish_reason is None:
                    self.engine.abort(rid)  # interrupted: leave the engine clean
        return results


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, Seq) and not isinstance(p, str)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return prompts
