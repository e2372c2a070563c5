"""Per-request sampling parameters and finish reasons, shared by every layer."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# Bounds every layer applies (the gateway's request schema uses the same numbers).
# OpenAI's documented ranges where it has one; physical limits elsewhere.
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-2  # above 0: smaller ones overflow the logits; 0 is greedy
MAX_PENALTY = 2.0  # presence / frequency: [-2, 2]
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 10.0
MAX_TOP_K = 2**31 - 1  # no vocabulary is larger; the gateway checks the served one's size
MAX_SEED = 2**63 - 1
MAX_TOKENS_LIMIT = 2**31 - 1  # max_tokens / min_tokens: no context is longer
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # each step re-applies them: bounded per request


class FinishReason(str, enum.Enum):
    """Why a sequence stopped: OpenAI's vocabulary plus ``abort``."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller or the server


def _check_number(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; validated on construction.

    ``temperature == 0`` is greedy. ``top_k`` of ``None`` (or 0 / -1, as other
    servers spell it) disables top-k. ``seed`` makes one request reproducible
    whatever else shares its batch. ``logit_bias`` maps token ids to a bias added to
    the model's logits before anything else (a dict, or ``(token id, bias)`` pairs;
    kept as pairs sorted by id).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k in (0, -1):
            object.__setattr__(self, "top_k", None)
        bias = self.logit_bias or ()
        try:
            pairs = tuple((t, b) for t, b in (bias.items() if isinstance(bias, Mapping) else bias))
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to biases") from None
        object.__setattr__(self, "logit_bias", pairs)
        self._validate()
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))

    def _validate(self) -> None:
        _check_number("n", self.n, integer=True)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            _check_number(name, getattr(self, name))
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be 0 or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k is not None:
            _check_number("top_k", self.top_k, integer=True)
            if not 1 <= self.top_k <= MAX_TOP_K:
                raise ValueError(f"top_k must be in [1, {MAX_TOP_K}] (or 0/-1/None to disable), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True)
            if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
                raise ValueError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {s!r:.80}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_number("stop_token_ids", t, integer=True)
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"stop_token_ids must be in [0, {MAX_TOKEN_ID}], got {t}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} token ids, "
                             f"got {len(self.logit_bias)}")
        for t, b in self.logit_bias:
            _check_number("logit_bias token ids", t, integer=True)
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"logit_bias token ids must be in [0, {MAX_TOKEN_ID}], got {t}")
            _check_number("logit_bias values", b)
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {b} for token {t}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias names a token id more than once")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice ``index`` of ``n``: one output each, seeded by :func:`choice_seed`."""
        if self.n == 1:
            return self
        return dataclasses.replace(self, n=1, seed=choice_seed(self.seed, index))


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``: seed + index."""
    return None if seed is None else (seed + index) % 2**63
