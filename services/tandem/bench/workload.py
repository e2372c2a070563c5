"""Workloads: the request sequence of a run (prompts with exact token lengths, output lengths).

A synthetic workload is a weighted mix of request classes, each with an input- and an
output-length distribution (``"128"``: fixed; ``"uniform:64-256"``: uniform on the closed
range). Prompts are lists of token ids drawn from the checkpoint's ordinary (non-special)
ids, so the server sees exactly ``input_len`` prompt tokens without any detokenize /
retokenize drift; with ``ignore_eos`` it generates exactly ``output_len`` tokens.
Everything is drawn from one seeded generator: the same seed gives the same sequence
for every server and rate. Named presets live in ``PRESETS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Token ids used when no tokenizer is given: ordinary ids in most vocabularies (>= 1000).
FALLBACK_TOKEN_IDS = range(16, 1000)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed`` (low == high) or ``uniform`` on [low, high]."""

    kind: str
    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> LengthDist:
        """``"128"`` | ``"uniform:64-256"``; ValueError naming the forms otherwise."""
        s = str(text).strip()
        try:
            if s.isdigit():
                dist = cls("fixed", int(s), int(s))
            elif s.startswith("uniform:"):
                lo, hi = s[len("uniform:"):].split("-")
                dist = cls("uniform", int(lo), int(hi))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"a length is N or uniform:LOW-HIGH, got {text!r}") from None
        if dist.low < 1 or dist.high < dist.low:
            raise ValueError(f"a length needs 1 <= LOW <= HIGH, got {text!r}")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` lengths."""
        if self.kind == "fixed":
            return [self.low] * n
        return rng.integers(self.low, self.high + 1, size=n).tolist()

    def mean(self) -> float:
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        return str(self.low) if self.kind == "fixed" else f"uniform:{self.low}-{self.high}"


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix, with its share."""

    name: str
    weight: float
    input_len: LengthDist
    output_len: LengthDist

    def to_json(self) -> dict:
        return {"name": self.name, "weight": self.weight, "input_len": str(self.input_len),
                "output_len": str(self.output_len)}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a run: ``prompt`` is token ids (exact length) or text (dataset, no tokenizer)."""

    index: int
    prompt: list[int] | str
    prompt_len: int | None
    output_len: int
    kind: str


@dataclass(frozen=True)
class Preset:
    """A named workload with the defaults that make it meaningful on the ``bench`` model."""

    name: str
    description: str
    classes: tuple[RequestClass, ...]
    num_prompts: int
    rates: str
    slo_ttft_ms: float
    slo_tpot_ms: float


def _cls(name: str, weight: float, inp: str, out: str) -> RequestClass:
    return RequestClass(name, weight, LengthDist.parse(inp), LengthDist.parse(out))


# Sized for the `bench` checkpoint on a 2-core machine (1 thread per worker, 2 workers):
# rate steps short enough that a compare of two systems takes minutes, not hours. The SLOs
# are a few times the unloaded latencies there (interference: a 1024-token prefill and a
# decode step on one thread); scale them with --slo-* elsewhere.
PRESETS: dict[str, Preset] = {
    "chat": Preset(
        "chat", "chat-like mix: mostly short turns, some with a long context; medium replies",
        (_cls("turn", 0.7, "uniform:32-256", "uniform:32-160"),
         _cls("context", 0.3, "uniform:256-1024", "uniform:16-128")),
        num_prompts=40, rates="1,2,3,4", slo_ttft_ms=1000.0, slo_tpot_ms=60.0),
    "interference": Preset(
        "interference", "long prompts arriving while many streams decode: most requests are "
        "short-prompt/long-output streams, a fraction bring a very long prompt and want few tokens",
        (_cls("stream", 0.8, "32", "128"), _cls("long-prompt", 0.2, "1024", "16")),
        num_prompts=50, rates="1.5,2.5,3.5", slo_ttft_ms=2500.0, slo_tpot_ms=60.0),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown workload preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def ordinary_token_ids(tokenizer: object | None) -> list[int]:
    """Ids a synthetic prompt may use: the tokenizer's non-special ids, or a safe fallback range."""
    if tokenizer is None:
        return list(FALLBACK_TOKEN_IDS)
    ids = [i for i in range(tokenizer.vocab_size) if not tokenizer.is_special(i)]  # type: ignore[attr-defined]
    if not ids:
        raise ValueError("the tokenizer has no ordinary token ids")
    return ids


def synthetic(classes: Sequence[RequestClass], n: int, seed: int, token_ids: Sequence[int],
              salt: int = 0, run: int = 0) -> list[BenchRequest]:
    """``n`` requests of the mix ``classes``, reproducible from ``seed``, ``salt`` and ``run``.

    The classes and lengths depend on ``seed`` only; the prompts' token ids on all three:
    a sweep uses one salt per rate and one ``run`` salt for the whole run, so every rate
    sees the same shapes but no prompt a server has seen before, in this run or an earlier
    one (a prefix cache would otherwise skip the prefills).
    """
    if not classes:
        raise ValueError("a synthetic workload needs at least one request class")
    weights = np.array([c.weight for c in classes], dtype=float)
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError("request class weights must be >= 0 and not all 0")
    rng = np.random.default_rng(seed)
    ids_rng = np.random.default_rng([seed, salt, run])
    probs = weights / weights.sum()
    pool = np.asarray(token_ids)
    out = []
    for i in range(n):  # one request at a time: a shorter run is a prefix of a longer one
        c = classes[int(rng.choice(len(classes), p=probs))]
        in_len = c.input_len.sample(rng, 1)[0]
        out_len = c.output_len.sample(rng, 1)[0]
        prompt = pool[ids_rng.integers(0, len(pool), size=in_len)].tolist()
        out.append(BenchRequest(i, prompt, in_len, out_len, c.name))
    return out


def describe(requests: Sequence[BenchRequest]) -> dict:
    """Counts and mean lengths per request class (for the results' config block)."""
    kinds: dict[str, dict] = {}
    for r in requests:
        k = kinds.setdefault(r.kind, {"count": 0, "prompt_tokens": 0, "output_tokens": 0})
        k["count"] += 1
        k["prompt_tokens"] += r.prompt_len or 0
        k["output_tokens"] += r.output_len
    return {name: {"count": k["count"], "mean_prompt_tokens": k["prompt_tokens"] / k["count"],
                   "mean_output_tokens": k["output_tokens"] / k["count"]} for name, k in kinds.items()}
