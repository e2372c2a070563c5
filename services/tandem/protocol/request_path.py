"""Request-path messages between gateway, router and workers (services/ARCHITECTURE.md,
"The request's path").

Plain frozen dataclasses (Ray pickles them; no schema needed): the router
sends a :class:`PrefillRequest` to P and a :class:`DecodeRequest` to D; P
answers with a :class:`PrefillResult` (token #1 goes straight to the caller);
D streams :class:`TokenDelta` s.

Re-drive: every :class:`TokenDelta` carries ``index``, the position in the
output of its first token, so a caller that re-drives a request on another
worker drops what it already has with :meth:`TokenDelta.after`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.protocol.messages import KVTransferDescriptor

__all__ = ["DecodeRequest", "PrefillRequest", "PrefillResult", "TokenDelta", "TokenLogprob"]


def _check_int(name: str, value: object, lo: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of token ids, got {ids!r}")
    out = tuple(ids)  # type: ignore[arg-type]
    for t in out:
        _check_int(f"{name} entry", t)
    return out


def _check_request_id(value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"request_id must be a non-empty string, got {value!r}")


def _prompt_ids(ids: object) -> tuple[int, ...]:
    out = _token_ids("prompt_token_ids", ids)
    if not out:
        raise ValueError("prompt_token_ids must not be empty")
    return out


def _check_descriptor(descriptor: object, request_id: str) -> None:
    if descriptor is None:
        return
    if not isinstance(descriptor, KVTransferDescriptor):
        raise ValueError(f"descriptor must be a KVTransferDescriptor or None, "
                         f"got {type(descriptor).__name__}")
    if descriptor.request_id != request_id:
        raise ValueError(f"descriptor is for request {descriptor.request_id!r}, not {request_id!r}")


def _check_params(value: object) -> None:
    if not isinstance(value, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(value).__name__}")


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one chosen token and its top-N alternatives ``(token_id, logprob)``,
    highest first. Mirrors the engine's ``TokenLogprob`` (see :meth:`of`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_int("token_id", self.token_id)
        object.__setattr__(self, "logprob", float(self.logprob))
        object.__setattr__(self, "top", tuple((int(t), float(lp)) for t, lp in self.top))

    @classmethod
    def of(cls, obj: Any) -> TokenLogprob:
        """From anything with ``token_id``, ``logprob`` and ``top`` (the engine's record)."""
        if isinstance(obj, cls):
            return obj
        return cls(obj.token_id, obj.logprob, tuple(obj.top))


@dataclass(frozen=True)
class PrefillRequest:
    """Router -> P: compute the prompt's KV, sample token #1, push the KV to D.

    ``descriptor`` is D's reservation (where the KV goes); ``None`` means keep the
    KV local (colocated mode, or a P that also decodes).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    descriptor: KVTransferDescriptor | None = None

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        object.__setattr__(self, "prompt_token_ids", _prompt_ids(self.prompt_token_ids))
        _check_params(self.sampling_params)
        _check_descriptor(self.descriptor, self.request_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class PrefillResult:
    """P -> router: token #1 (sampled from P's own logits) and what the prefill cost."""

    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    first_logprob: TokenLogprob | None = None
    num_cached_tokens: int = 0  # prompt tokens served from P's prefix cache
    kv_bytes: int = 0  # KV bytes pushed to D (0 when kept local)
    # set when token #1 already ends the request (EOS, a stop token id, max_tokens 1, the
    # context): the caller finishes it here, no decode step follows
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        _check_int("first_token_id", self.first_token_id)
        if self.finish_reason is not None:
            object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))
        _check_int("num_prompt_tokens", self.num_prompt_tokens, 1)
        _check_int("num_cached_tokens", self.num_cached_tokens)
        if self.num_cached_tokens > self.num_prompt_tokens:
            raise ValueError(f"num_cached_tokens ({self.num_cached_tokens}) exceeds "
                             f"num_prompt_tokens ({self.num_prompt_tokens})")
        _check_int("kv_bytes", self.kv_bytes)
        if self.first_logprob is not None:
            object.__setattr__(self, "first_logprob", TokenLogprob.of(self.first_logprob))


@dataclass(frozen=True)
class DecodeRequest:
    """Router -> D: decode a request whose first ``len(output_token_ids)`` tokens exist.

    ``output_token_ids`` holds token #1 from P, or, on a re-drive after a decode
    worker died, every token already streamed to the caller (D re-prefills
    prompt + these and continues; its deltas start at ``index ==
    len(output_token_ids)``). ``descriptor`` is the transfer D reserved blocks
    for; ``None`` means D prefills locally (conditional disaggregation, re-drive).
    ``migrated``: the request moved here from another decode worker, whose KV for
    every token but the last is in the blocks D reserved for it (``descriptor``, if
    set, names the last round of that copy); D continues after ``output_token_ids``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    output_token_ids: tuple[int, ...] = ()
    descriptor: KVTransferDescriptor | None = None
    migrated: bool = False

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        object.__setattr__(self, "prompt_token_ids", _prompt_ids(self.prompt_token_ids))
        object.__setattr__(self, "output_token_ids",
                           _token_ids("output_token_ids", self.output_token_ids))
        _check_params(self.sampling_params)
        _check_descriptor(self.descriptor, self.request_id)

    @property
    def prefill_locally(self) -> bool:
        return self.descriptor is None and not self.migrated

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class TokenDelta:
    """D (or P, for token #1) -> caller: new tokens of one request.

    ``index`` is the output position of ``token_ids[0]``; the next delta starts
    at :attr:`next_index`. ``finish_reason`` is set exactly when ``finished``.
    ``logprobs``, when present, has one entry per token.
    """

    request_id: str
    token_ids: tuple[int, ...]
    index: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        object.__setattr__(self, "token_ids", _token_ids("token_ids", self.token_ids))
        _check_int("index", self.index)
        if not isinstance(self.finished, bool):
            raise ValueError(f"finished must be a bool, got {self.finished!r}")
        if self.finish_reason is not None:
            object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))
        if self.finished != (self.finish_reason is not None):
            raise ValueError("finish_reason must be set exactly when finished "
                             f"(finished={self.finished}, finish_reason={self.finish_reason})")
        if self.logprobs is not None:
            lps = tuple(TokenLogprob.of(lp) for lp in self.logprobs)
            if len(lps) != len(self.token_ids):
                raise ValueError(f"{len(lps)} logprobs for {len(self.token_ids)} tokens")
            object.__setattr__(self, "logprobs", lps)

    @property
    def next_index(self) -> int:
        return self.index + len(self.token_ids)

    def after(self, received: int) -> TokenDelta | None:
        """The part of this delta at output positions ``>= received``; ``None`` if nothing
        new remains (a duplicate after a re-drive, and not the finishing delta).

        Raises ``ValueError`` if the delta starts past ``received``: tokens would be lost.
        """
        _check_int("received", received)
        if self.index > received:
            raise ValueError(f"gap in the token stream of {self.request_id!r}: have "
                             f"{received} tokens, delta starts at {self.index}")
        skip = received - self.index
        if skip == 0:
            return self
        if skip >= len(self.token_ids) and not self.finished:
            return None
        skip = min(skip, len(self.token_ids))
        return TokenDelta(self.request_id, self.token_ids[skip:], self.index + skip,
                          self.finished, self.finish_reason,
                          None if self.logprobs is None else self.logprobs[skip:])
