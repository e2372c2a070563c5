"""Token sampling for one engine step: penalties, masks, seeded draws, logprobs.

Pipeline per row (vLLM's order): logit bias -> repetition penalty ->
presence/frequency penalties -> banned ids -> temperature -> top-k -> top-p ->
min-p -> sample.
Greedy rows (``temperature == 0``) take the argmax of the penalised logits and
consume no randomness. A random row draws one uniform ``u`` and takes the token
where ``u`` falls in its cumulative distribution (float64 sums, vocabulary order;
a token of probability 0 has an empty interval and is never drawn): one number
per row, where drawing a noise value per vocabulary entry was slow on a CPU over a
large vocabulary (services/RESULTS.md). A seeded row's ``u`` for output token ``i`` is a
hash of ``(seed, i)`` alone (see :func:`noise_key`): the draw depends on nothing
else that shares the batch or on what ran before, so the same request gives the
same tokens on one engine, across a prefill -> decode hand-off, after preemption
and after a re-drive on another worker.
Logprobs come from the raw logits (before bias, penalties, temperature and masks).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.common.sampling_params import SamplingParams
from tandem.engine.kernels.cpu_kernels import CpuKernels
from tandem.engine.sampling_masks import apply_sampling_masks


@dataclass
class SamplingBatch:
    """The rows of one step that sample a token."""

    params: list[SamplingParams]  # one per row
    prompt_token_ids: list[Sequence[int]]  # per row (repetition penalty)
    # Per row, generated so far: penalties, and the output index that keys a seeded draw.
    output_token_ids: list[Sequence[int]]
    # Per row, ids that must not be sampled this step (EOS/stop ids before min_tokens).
    banned_token_ids: list[Sequence[int]]


@dataclass
class TokenLogprob:
    """Logprob of the chosen token plus the top-N alternatives (raw logits)."""

    token_id: int
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # top-N (token_id, logprob), highest first


@dataclass
class SamplerOutput:
    """One sampled token per row, with logprobs where requested."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where params.logprobs is None


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``.

    A stateless hash (SplitMix64 finaliser) of the pair, so the noise of each token
    is a pure function of (seed, index): nothing has to travel between workers but
    the seed and the number of tokens generated so far.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)) >> 1  # < 2**63


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform draw in [0, 1) for output token ``index`` of a request seeded with
    ``seed``: the top 53 bits of its :func:`noise_key`."""
    return (noise_key(seed, index) >> 10) * 2.0 ** -53


def draw_from(probs: torch.Tensor, u: torch.Tensor, kernels: CpuKernels | None = None
              ) -> torch.Tensor:
    """Inverse-CDF draws: ``probs [R, V]`` (rows need not sum to 1), ``u [R]`` float64
    in [0, 1) -> ``[R]`` long, the first token whose float64 cumulative mass exceeds
    ``u * total``. ``kernels``: the native CPU kernels, which draw from contiguous fp32
    CPU rows with the same sums in the same order, skipping the zeros (the same tokens,
    sooner); rows whose total is not finite and positive are drawn here."""
    if kernels is not None and probs.device.type == "cpu" and probs.dtype == torch.float32 \
            and probs.dim() == 2 and probs.shape[1] > 0 and probs.is_contiguous():
        tokens = kernels.inverse_cdf(probs, u.to(torch.float64).contiguous())  # [R]
        undecided = tokens < 0  # [R]
        if bool(undecided.any()):
            tokens[undecided] = draw_from(probs[undecided], u[undecided])
        return tokens
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]  # [R, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _flat_index(seqs: Sequence[Sequence[int]], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for ragged ``seqs``; ids outside [0, V) dropped."""
    lengths = [len(s) for s in seqs]
    tok = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)  # [N]
    row = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths, dtype=torch.long))  # [N]
    ok = (tok >= 0) & (tok < vocab_size)
    return row[ok].to(device), tok[ok].to(device)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits [B, V]; returns a new tensor if any apply."""
    pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not pairs:
        return logits
    dev = logits.device
    rows, ids, biases = zip(*pairs)
    out = logits.clone()
    out[torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)] += torch.tensor(
        biases, dtype=logits.dtype, device=dev)  # (row, id) pairs are unique
    return out


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, presence and frequency penalties; returns a new tensor if any apply.

    Repetition (HF): for tokens in prompt+output, ``logit / r`` if positive else
    ``logit * r``. Presence/frequency (OpenAI), over output tokens only:
    ``logit -= presence * (count > 0) + frequency * count``.
    """
    rows = [i for i, p in enumerate(batch.params) if p.uses_penalties]
    if not rows:
        return logits
    dev, (_, vocab) = logits.device, logits.shape
    ps = [batch.params[i] for i in rows]
    idx = torch.tensor(rows, dtype=torch.long, device=dev)  # [R]
    x = logits[idx]  # [R, V]

    counts = torch.zeros(len(rows), vocab, dtype=logits.dtype, device=dev)  # [R, V]
    r, t = _flat_index([batch.output_token_ids[i] for i in rows], vocab, dev)
    counts.index_put_((r, t), torch.ones_like(t, dtype=logits.dtype), accumulate=True)

    rep = torch.tensor([p.repetition_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]  # [R, 1]
    if bool((rep != 1.0).any()):
        seen = counts > 0  # [R, V] prompt or output
        r, t = _flat_index([batch.prompt_token_ids[i] for i in rows], vocab, dev)
        seen[r, t] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)

    pres = torch.tensor([p.presence_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]  # [R, 1]
    freq = torch.tensor([p.frequency_penalty for p in ps], dtype=x.dtype, device=dev)[:, None]  # [R, 1]
    x = x - pres * (counts > 0).to(x.dtype) - freq * counts

    out = logits.clone()
    out[idx] = x
    return out


def apply_banned(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set banned ids to -inf per row; returns a new tensor if any are banned."""
    if not any(len(b) for b in banned):
        return logits
    r, t = _flat_index(banned, logits.shape[1], logits.device)
    out = logits.clone()
    out[r, t] = float("-inf")
    return out


class Sampler:
    """Samples one token per row of a step's logits; see the module docstring."""

    def __init__(self, seed: int | None = None, kernels: CpuKernels | None = None) -> None:
        """``seed`` fixes the shared generator used by rows without their own;
        ``kernels``: the native CPU kernels, for argmaxes over CPU logits, the candidates
        of top-k/top-p (``sampling_masks``) and the draws (``draw_from``)."""
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self.kernels = kernels

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, V]`` -> ``[B]`` long: each row's first maximum (first NaN), as
        ``x.argmax(dim=-1)``; natively over contiguous fp32 CPU rows (torch's CPU argmax
        runs on one thread, element by element: slow over a large vocabulary)."""
        if self.kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32 \
                and x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous():
            return self.kernels.argmax(x)
        return x.argmax(dim=-1)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The shared generator for ``device`` (created on first use)."""
        g = self._shared.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self._seed is None:
                g.seed()
            else:
                g.manual_seed(self._seed)
            self._shared[device] = g
        return g

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from ``logits`` [B, V] (any float dtype, any device)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        bsz, vocab = logits.shape
        for name in ("params", "prompt_token_ids", "output_token_ids", "banned_token_ids"):
            if len(getattr(batch, name)) != bsz:
                raise ValueError(
                    f"SamplingBatch.{name} has {len(getattr(batch, name))} rows, logits have {bsz}")
        dev = logits.device
        raw = logits.float()  # [B, V]
        x = apply_logit_bias(raw, batch.params)  # [B, V]
        x = apply_banned(apply_penalties(x, batch), batch.banned_token_ids)

        params = batch.params
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if not rand:
            tokens = self.argmax(x)  # [B]
        else:
            tokens = self.argmax(x) if len(rand) < bsz else torch.empty(bsz, dtype=torch.long, device=dev)
            tokens[self._index(rand, bsz, dev)] = self._sample_random(x, batch, rand)
        token_ids: list[int] = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw, tokens, params))

    @staticmethod
    def _index(rows: list[int], bsz: int, dev: torch.device) -> torch.Tensor | slice:
        return slice(None) if len(rows) == bsz else torch.tensor(rows, dtype=torch.long, device=dev)

    def _sample_random(self, x: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """Tokens [R] for the non-greedy ``rows`` of the penalised logits ``x`` [B, V]."""
        dev = x.device
        ps = [batch.params[i] for i in rows]
        xr = x[self._index(rows, x.shape[0], dev)]  # [R, V]
        temp = torch.tensor([p.temperature for p in ps], dtype=xr.dtype, device=dev)  # [R]
        xr = xr / temp[:, None]
        vocab = xr.shape[1]
        top_k = top_p = min_p = None
        if any(p.top_k is not None for p in ps):
            top_k = torch.tensor([p.top_k or vocab for p in ps], dtype=torch.long, device=dev)  # [R]
        if any(p.top_p < 1.0 for p in ps):
            top_p = torch.tensor([p.top_p for p in ps], dtype=xr.dtype, device=dev)  # [R]
        if any(p.min_p > 0.0 for p in ps):
            min_p = torch.tensor([p.min_p for p in ps], dtype=xr.dtype, device=dev)  # [R]
        if top_k is not None or top_p is not None or min_p is not None:
            xr = apply_sampling_masks(xr, top_k, top_p, min_p, self.kernels)
        probs = torch.softmax(xr, dim=-1)  # [R, V]
        keys = [(p.seed, len(batch.output_token_ids[i])) if p.seed is not None else None
                for i, p in zip(rows, ps)]
        return draw_from(probs, self._uniforms(keys, dev), self.kernels)  # [R]

    def _uniforms(self, keys: list[tuple[int, int] | None], dev: torch.device) -> torch.Tensor:
        """``[R]`` float64 draws in [0, 1): keyed by (seed, output index) per seeded row,
        from the shared generator for the rest."""
        u = torch.tensor([0.0 if k is None else seeded_uniform(*k) for k in keys],
                         dtype=torch.float64)  # [R]
        shared = [j for j, k in enumerate(keys) if k is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=torch.float64, device=dev,
                                   generator=self.shared_generator(dev)).cpu()
        return u

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                  params: list[SamplingParams]) -> list[TokenLogprob | None]:
        """Logprobs from the raw logits ``raw`` [B, V] for rows that ask for them."""
        out: list[TokenLogprob | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return out
        idx = torch.tensor(rows, dtype=torch.long, device=raw.device)  # [W]
        lp = torch.log_softmax(raw[idx], dim=-1)  # [W, V]
        chosen = lp.gather(1, tokens[idx][:, None]).squeeze(1).tolist()  # [W]
        n = min(max(params[i].logprobs or 0 for i in rows), raw.shape[1])
        top_v: list[list[float]] = [[] for _ in rows]
        top_i: list[list[int]] = [[] for _ in rows]
        if n > 0:
            v, t = lp.topk(n, dim=-1)  # [W, n] each, highest first
            top_v, top_i = v.tolist(), t.tolist()
        tok = tokens[idx].tolist()
        for j, i in enumerate(rows):
            k = params[i].logprobs or 0
            out[i] = TokenLogprob(tok[j], chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return out
