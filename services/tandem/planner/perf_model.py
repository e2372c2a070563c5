"""Step-time models fitted to a ``tandem profile``: what one engine step costs, what a KV
transfer costs. Pure numpy; ``tandem plan``'s simulator evaluates them millions of times.

- Prefill: ``prefill = base + per_token * tokens + per_pair * pairs`` (least squares), ``pairs``
  the causal attention's query-key pairs (``attention_pairs``): linear in tokens for the
  matmuls, quadratic in each prompt's length for attention (one 1024-token prompt costs
  more than four of 256).
- Decode: ``decode(batch, context) = base + per_seq * batch + per_ctx * context`` (least
  squares, coefficients clipped at 0), ``context`` the total KV tokens the batch attends to.
- A mixed step (decodes plus a prefill chunk, as chunked prefill schedules it):
  ``prefill(tokens, pairs) + per_seq * batch + per_ctx * context``: the decodes' marginal
  cost rides on the prefill's fixed cost.
- Transfer: ``transfer(bytes) = latency + bytes / bandwidth`` (least squares).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.bench.metrics_math import lstsq_nonneg


def _median_by(points: Sequence[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, float]:
    groups: dict[tuple, list[float]] = {}
    for p in points:
        groups.setdefault(tuple(p[k] for k in keys), []).append(p["seconds"])
    return {k: float(np.median(v)) for k, v in groups.items()}


def attention_pairs(tokens: int, prior: int = 0) -> float:
    """Query-key pairs a causal prompt chunk of ``tokens`` tokens after ``prior`` cached ones computes."""
    return tokens * (prior + (tokens + 1) / 2)


@dataclass(frozen=True)
class PrefillModel:
    """``seconds = base + per_token * tokens + per_pair * attention pairs`` of one step's prompt chunks."""

    base: float
    per_token: float
    per_pair: float

    @classmethod
    def fit(cls, points: Sequence[dict[str, Any]]) -> PrefillModel:
        """``points``: ``{"tokens", "pairs", "seconds"}`` per timed step (medians per shape are fitted)."""
        med = _median_by(points, ("tokens", "pairs"))
        if len(med) < 3:
            raise ValueError("a prefill fit needs steps of at least three shapes")
        a = np.array([[1.0, t, p] for t, p in med])
        coef = lstsq_nonneg(a, np.array(list(med.values())))
        return cls(*map(float, coef))

    def __call__(self, tokens: float, pairs: float | None = None) -> float:
        """Seconds of a step computing ``tokens`` prompt tokens (``pairs``: default one fresh prompt)."""
        if tokens <= 0:
            return 0.0
        if pairs is None:
            pairs = attention_pairs(int(tokens))
        return self.base + self.per_token * tokens + self.per_pair * pairs

    def scaled(self, f: float) -> PrefillModel:
        return PrefillModel(self.base * f, self.per_token * f, self.per_pair * f)

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "per_token": self.per_token, "per_pair": self.per_pair}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrefillModel:
        return cls(d["base"], d["per_token"], d["per_pair"])


@dataclass(frozen=True)
class DecodeModel:
    base: float
    per_seq: float
    per_ctx: float  # seconds per KV token attended

    @classmethod
    def fit(cls, points: Sequence[dict[str, Any]]) -> DecodeModel:
        """``points``: ``{"batch", "context", "seconds"}`` per timed step (context: total)."""
        med = _median_by(points, ("batch", "context"))
        if len(med) < 3:
            raise ValueError("a decode fit needs at least three (batch, context) points")
        a = np.array([[1.0, b, c] for b, c in med])
        return cls(*map(float, lstsq_nonneg(a, np.array(list(med.values())))))

    def __call__(self, batch: int, context: float) -> float:
        """Seconds of a decode step of ``batch`` sequences attending ``context`` KV tokens in all."""
        return self.base + self.per_seq * batch + self.per_ctx * context if batch > 0 else 0.0

    def marginal(self, batch: int, context: float) -> float:
        """The decodes' cost when they ride along a prefill chunk (no fixed cost)."""
        return self.per_seq * batch + self.per_ctx * context

    def scaled(self, f: float) -> DecodeModel:
        return DecodeModel(self.base * f, self.per_seq * f, self.per_ctx * f)

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "per_seq": self.per_seq, "per_ctx": self.per_ctx}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DecodeModel:
        return cls(d["base"], d["per_seq"], d["per_ctx"])


@dataclass(frozen=True)
class TransferModel:
    latency: float
    seconds_per_byte: float

    @classmethod
    def fit(cls, points: Sequence[dict[str, Any]]) -> TransferModel:
        """``points``: ``{"bytes", "seconds"}``; needs two sizes at least. A noisy profile whose
        times do not grow with the size gets a pure latency (no negative bandwidth term)."""
        med = _median_by(points, ("bytes",))
        if len(med) < 2:
            raise ValueError("a transfer fit needs at least two sizes")
        a = np.array([[1.0, b] for (b,) in med])
        return cls(*map(float, lstsq_nonneg(a, np.array(list(med.values())))))

    def __call__(self, nbytes: float) -> float:
        return self.latency + nbytes * self.seconds_per_byte

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"latency_s": self.latency, "seconds_per_byte": self.seconds_per_byte}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TransferModel:
        return cls(d["latency_s"], d["seconds_per_byte"])


@dataclass(frozen=True)
class StepModel:
    """One worker kind's step costs (full speed: the worker alone on its cores)."""

    prefill: PrefillModel
    decode: DecodeModel

    def scaled(self, f: float) -> StepModel:
        """Every step ``f`` times as long (e.g. back to a quiet machine from a busy one)."""
        return StepModel(self.prefill.scaled(f), self.decode.scaled(f))

    def served(self, prefill_factor: float, decode_factor: float) -> StepModel:
        """Steps as a served worker runs them: the prompt part ``prefill_factor`` and the
        decode part ``decode_factor`` times the profiled cost."""
        return StepModel(self.prefill.scaled(prefill_factor), self.decode.scaled(decode_factor))

    def step(self, prefill_tokens: int, prefill_pairs: float, decode_batch: int, decode_context: float) -> float:
        """Seconds of one engine step computing prompt chunks (``prefill_pairs``: their attention
        pairs, ``attention_pairs``) and ``decode_batch`` decodes attending ``decode_context`` tokens."""
        return sum(self.parts(prefill_tokens, prefill_pairs, decode_batch, decode_context))

    def parts(self, prefill_tokens: int, prefill_pairs: float, decode_batch: int,
              decode_context: float) -> tuple[float, float]:
        """``step``'s seconds as (the prompt part, the decode part): a step with prompt tokens
        pays the prefill's fixed cost, one without the decode's."""
        if prefill_tokens > 0:
            return (self.prefill(prefill_tokens, prefill_pairs), self.decode.marginal(decode_batch, decode_context))
        return 0.0, self.decode(decode_batch, decode_context)
