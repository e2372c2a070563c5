"""Verification by resampling: the rejection rule for point-mass drafts, exact in law.

Each trial verifies a one-token draft ``d`` with the target's two positions
sampled as the runner samples them (rows of one ``Sampler`` call, the second
row seeing ``d`` as its output so far). Chi-square against the target laws with
a fixed critical value; the shared generator is seeded so the test is fixed.
"""

from __future__ import annotations

import pytest
import torch

from tandem.common.sampling_params import SamplingParams
from tandem.engine.sampler import Sampler, SamplingBatch, apply_sampling_masks
from tandem.engine.spec.verifier import DraftPrefix, accepted_length

V = 6
N = 30000
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}

LOGITS = torch.tensor([[2.0, 1.4, 1.0, 0.5, -0.3, -1.0],  # position 0
                       [0.2, 1.1, -0.4, 1.6, 0.9, -2.0]])  # position 1, after the draft token
PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.9, top_k=4),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
    "min_p+top_k": SamplingParams(temperature=1.0, top_k=5, min_p=0.15),
}


def _target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The law the plain sampler draws from at one position: [V]."""
    x = (logits / p.temperature)[None]
    x = apply_sampling_masks(x, torch.tensor([p.top_k]) if p.top_k else None,
                             torch.tensor([p.top_p]) if p.top_p < 1 else None,
                             torch.tensor([p.min_p]) if p.min_p > 0 else None)
    return torch.softmax(x, dim=-1)[0].double()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    total = counts.sum()
    assert (counts[probs == 0] == 0).all(), "a masked token was committed"
    live = probs > 0
    expected = probs[live] * total
    return float(((counts[live] - expected) ** 2 / expected).sum()), int(live.sum()) - 1


def _verify_trials(params: SamplingParams, draft: int, seed: int = 0) -> list[list[int]]:
    """N verifications of the draft ``[draft]``; the committed tokens of each."""
    sampler = Sampler(seed)
    logits = LOGITS.repeat(N, 1)  # [2N, V]: rows (2i, 2i + 1) are trial i's positions
    outputs = [[] if j % 2 == 0 else DraftPrefix([], [draft]) for j in range(2 * N)]
    batch = SamplingBatch(params=[params] * (2 * N), prompt_token_ids=[[0]] * (2 * N),
                          output_token_ids=outputs, banned_token_ids=[()] * (2 * N))
    tokens = sampler(logits, batch).token_ids
    trials = []
    for i in range(N):
        samples = tokens[2 * i:2 * i + 2]
        trials.append(samples[:accepted_length(samples, [draft])])
    return trials


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_committed_tokens_follow_the_target_law(name):
    params = PARAMS[name]
    p0, p1 = _target(LOGITS[0], params), _target(LOGITS[1], params)
    draft = 1
    trials = _verify_trials(params, draft)
    first = torch.bincount(torch.tensor([t[0] for t in trials]), minlength=V).double()
    stat, dof = _chi2(first, p0)
    assert stat < CHI2_CRIT[dof], f"first token: chi2 {stat:.1f} with {dof} dof"
    # Acceptance happens with probability p0(d); then the bonus token follows p1.
    accepted = [t for t in trials if len(t) == 2]
    rate = len(accepted) / N
    assert rate == pytest.approx(float(p0[draft]), abs=4 * (0.25 / N) ** 0.5)
    bonus = torch.bincount(torch.tensor([t[1] for t in accepted]), minlength=V).double()
    stat, dof = _chi2(bonus, p1)
    assert stat < CHI2_CRIT[dof], f"bonus token: chi2 {stat:.1f} with {dof} dof"
    # On rejection: the target with the draft token removed, renormalised.
    rejected = torch.bincount(torch.tensor([t[0] for t in trials if len(t) == 1]),
                              minlength=V).double()
    residual = p0.clone()
    residual[draft] = 0
    stat, dof = _chi2(rejected, residual / residual.sum())
    assert stat < CHI2_CRIT[dof], f"correction token: chi2 {stat:.1f} with {dof} dof"


def test_a_draft_outside_the_top_k_is_always_rejected():
    params = PARAMS["top_k"]
    trials = _verify_trials(params, draft=5)  # the lowest logit, masked by top_k=4
    assert all(len(t) == 1 and t[0] != 5 for t in trials)


def test_seeded_rows_are_the_plain_stream():
    """A seeded position samples with the noise of its output index, so verification
    commits exactly the tokens the plain sampler would."""
    params = SamplingParams(temperature=1.0, seed=42)
    sampler = Sampler(0)
    rows = LOGITS[[0, 0, 0]]  # three positions with equal logits, outputs 0, 1, 2 long

    def plain(index: int) -> int:
        out = sampler(rows[:1], SamplingBatch([params], [[0]], [[9] * index], [()]))
        return out.token_ids[0]

    draft = [plain(0), (plain(1) + 1) % V]  # the first is right, the second wrong
    outs = [[], DraftPrefix([], draft[:1]), DraftPrefix([], draft)]
    samples = sampler(rows, SamplingBatch([params] * 3, [[0]] * 3, outs, [()] * 3)).token_ids
    assert samples[:accepted_length(samples, draft)] == [plain(0), plain(1)]


def test_accepted_length_is_the_matched_prefix_plus_one():
    assert accepted_length([5, 6, 7], [5, 6]) == 3  # all accepted, plus the bonus
    assert accepted_length([5, 9, 7], [5, 6]) == 2  # the second draft rejected
    assert accepted_length([4, 6, 7], [5, 6]) == 1  # a later match does not count
    assert accepted_length([3], []) == 1
    with pytest.raises(ValueError, match="one per draft token"):
        accepted_length([1, 2], [1, 2])


def test_draft_prefix_is_a_sequence():
    d = DraftPrefix([1, 2], [3])
    assert len(d) == 3 and list(d) == [1, 2, 3] and d[2] == 3 and d[-1] == 3 and d[0:2] == [1, 2]
