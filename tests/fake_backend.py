"""A deterministic in-process :class:`Backend` for tests and gateway-only benchmarks.

Token ``i + 1`` is ``(token_i * 7 + 3 + seed) % vocab_size``, starting from the
prompt's last token (``seed`` only shifts the first step, so choices with seeds
differ). Like the workers, it ends on EOS / stop token ids (the token is in the
finishing delta, ``finish_reason`` ``stop``), on ``max_tokens`` and on the context
length, and it neither detokenizes nor checks stop strings. It records every request
and whether its iterator was closed, so tests can assert that aborts reach it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.protocol.request_path import TokenDelta, TokenLogprob


@dataclass
class FakeRequest:
    """What the fake saw of one request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sent: int = 0  # tokens yielded
    finished: bool = False  # yielded its finishing delta
    closed: bool = False  # its iterator was finalized (finished, aborted or failed)

    @property
    def aborted(self) -> bool:
        """Closed before it finished: the gateway aborted it."""
        return self.closed and not self.finished


@dataclass
class FakeBackend:
    """See the module docstring. ``fail`` is raised after ``fail_after`` tokens (0: before
    any); ``hang_after`` stops producing (but keeps the request open) after that many
    tokens; ``delay_s`` is the time per delta; ``tokens_per_delta`` batches tokens like a
    busy decode worker; ``script``, if given, replaces the formula's output."""

    model_id: str = "fake-model"
    max_model_len: int = 256
    vocab_size: int = 1024
    eos_token_ids: frozenset[int] = frozenset()
    delay_s: float = 0.0
    first_delay_s: float = 0.0
    tokens_per_delta: int = 1
    hang_after: int | None = None
    fail: BaseException | None = None
    fail_after: int = 0
    script: Sequence[int] | None = None
    is_ready: bool = True
    requests: dict[str, FakeRequest] = field(default_factory=dict)

    # ----------------------------------------------------------------- Backend
    async def ready(self) -> bool:
        return self.is_ready

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenDelta]:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        rec = FakeRequest(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = rec
        return self._stream(rec)

    # ---------------------------------------------------------------- the model
    def tokens(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The whole output the fake produces for this request (the finishing stop token included)."""
        limit = min(params.max_tokens or 1 << 62, self.max_model_len - len(prompt_token_ids))
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        out: list[int] = []
        prev = prompt_token_ids[-1]
        while len(out) < limit:
            if self.script is not None:
                if len(out) == len(self.script):
                    break
                prev = self.script[len(out)]
            else:
                shift = (params.seed or 0) if not out else 0
                prev = (prev * 7 + 3 + shift) % self.vocab_size
            out.append(prev)
            if prev in stops and len(out) > params.min_tokens:
                break
        return out

    def logprob(self, token_id: int, num_top: int) -> TokenLogprob:
        """A made-up but deterministic logprob record for ``token_id``."""
        lp = -0.25 - (token_id % 7) / 4
        top = [(token_id, lp)] + [((token_id + k) % self.vocab_size, lp - k) for k in range(1, num_top)]
        return TokenLogprob(token_id, lp, tuple(top[:num_top]))

    def finish_reason(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                      tokens: Sequence[int]) -> FinishReason:
        """Why :meth:`tokens` ended."""
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return FinishReason.STOP if tokens and tokens[-1] in stops and len(tokens) > params.min_tokens \
            else FinishReason.LENGTH

    async def _stream(self, rec: FakeRequest) -> AsyncIterator[TokenDelta]:
        try:
            p = rec.params
            tokens = self.tokens(rec.prompt_token_ids, p)
            reason = self.finish_reason(rec.prompt_token_ids, p, tokens)
            if self.first_delay_s:
                await asyncio.sleep(self.first_delay_s)
            step = max(1, self.tokens_per_delta)
            for start in range(0, len(tokens), step):
                if self.fail is not None and start >= self.fail_after:
                    raise self.fail
                if self.hang_after is not None and start >= self.hang_after:
                    await asyncio.Event().wait()  # never set: only an abort ends this
                if start and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                chunk = tokens[start:start + step]
                done = start + step >= len(tokens)
                lps = None if p.logprobs is None else tuple(self.logprob(t, p.logprobs) for t in chunk)
                rec.sent += len(chunk)
                rec.finished = done
                yield TokenDelta(rec.request_id, tuple(chunk), start, done, reason if done else None, lps)
        finally:
            rec.closed = True

    # ------------------------------------------------------------------ checks
    def running(self) -> list[str]:
        """Ids of requests whose iterator is still open."""
        return [r.request_id for r in self.requests.values() if not r.closed]

    def matching(self, prefix: str) -> Iterable[FakeRequest]:
        """The requests whose id starts with ``prefix``."""
        return (r for r in self.requests.values() if r.request_id.startswith(prefix))
