"""Offline batch generation in the shape vLLM users know: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from tandem.common.config import EngineConfig
from tandem.common.config_fields import build_from_keywords
from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine.engine import LLMEngine
from tandem.engine.sampler import TokenLogprob
from tandem.text.output_processor import OutputProcessor

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

    ``model=None`` serves the embedded default, SmolLM2-135M-Instruct (converted into the
    cache on first use).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """``model``: a model folder, a ``.gguf`` file or a hub repo id (None: the default).

        ``options`` are the engine settings by keyword, with the defaults of
        :class:`EngineConfig` and its cache and scheduler configs: ``dtype``, ``device``,
        ``seed``, ``max_model_len``, ``num_threads``, ``onednn``, ``cpu_kernels``,
        ``block_size``, ``num_blocks``, ``kv_cache_memory_gb``, ``enable_prefix_caching``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``.
        An unknown keyword raises ``TypeError``.
        """
        self._start(build_from_keywords(EngineConfig, options, model=model))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` for an already-built engine config."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
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
        where: dict[str, tuple[RequestOutput, CompletionOutput, OutputProcessor]] = {}
        queue = []
        for prompt, ids, p in requests:
            req = RequestOutput(str(next(self._ids)), prompt, ids)
            results.append(req)
            for i in range(p.n):
                sub = p.for_choice(i)
                rid = f"{req.request_id}-{i}"
                comp = CompletionOutput(i, "", [], None, [] if p.logprobs is not None else None)
                req.outputs.append(comp)
                where[rid] = (req, comp, OutputProcessor(self.tokenizer, sub))
                queue.append((rid, ids, sub))
        try:
            for rid, ids, sub in queue:
                self.engine.add_request(rid, ids, sub)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    req, comp, proc = where[out.request_id]
                    if proc.finished:
                        continue  # ended by a stop string; its abort is already done
                    delta = proc.process(out.new_token_ids, out.finish_reason if out.finished else None,
                                         out.new_logprobs)
                    comp.token_ids.extend(delta.token_ids)
                    comp.text += delta.text
                    if comp.logprobs is not None:
                        comp.logprobs.extend(delta.logprobs or ())
                    if delta.finished:
                        comp.finish_reason = delta.finish_reason
                        req.num_cached_tokens = out.num_cached_tokens
                        if delta.stopped_by_text:
                            self.engine.abort(out.request_id)
        finally:
            for rid, (_, comp, _) in where.items():
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
