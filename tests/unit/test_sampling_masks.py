"""Top-k/top-p decided among each row's candidates (its largest logits by ``topk``, or the
tokens above the native kernel's floor) gives the full sort's masks."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import sampling_masks
from tandem.engine.kernels import cpu_kernels
from tandem.engine.sampling_masks import apply_sampling_masks


def _full_sort(monkeypatch, *args):
    monkeypatch.setattr(sampling_masks, "_decide_among_candidates", lambda *a: None)
    try:
        return apply_sampling_masks(*args)
    finally:
        monkeypatch.undo()


def _rows(seed: int, bsz: int, vocab: int) -> torch.Tensor:
    """Peaked rows, flat rows and rows full of ties (rounded logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, vocab, generator=g)
    x[0::3] *= 6.0  # peaked: top-p sets of a few tokens
    x[1::3] = (x[1::3] * 2).round() / 2  # many ties, at every boundary
    return x


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("candidates", [4, 16, 64])
def test_candidate_masks_equal_full_sort_masks(monkeypatch, sampling_kernels, seed, candidates):
    bsz, vocab = 12, 300
    x = _rows(seed, bsz, vocab)
    g = torch.Generator().manual_seed(100 + seed)
    top_k = torch.randint(1, candidates + 1, (bsz,), generator=g)
    top_k[::4] = vocab  # off
    top_k[2::4] = torch.randint(candidates + 1, vocab, (3,), generator=g)  # beyond the candidates
    top_p = torch.rand(bsz, generator=g) * 0.9 + 0.05
    top_p[1::5] = 1.0  # off
    decided = 0
    for rows in [slice(None), *(slice(i, i + 1) for i in range(bsz))]:  # the batch, each row
        for k, p in ((top_k[rows], None), (None, top_p[rows]), (top_k[rows], top_p[rows])):
            want = _full_sort(monkeypatch, x[rows], k, p)
            monkeypatch.setattr(sampling_masks, "CANDIDATES", candidates)
            monkeypatch.setattr(sampling_masks, "WIDE_CANDIDATES", 4 * candidates)
            *_, redo = sampling_masks._decide_among_candidates(
                x[rows], None if k is None else k.clamp(1, vocab), p, sampling_kernels)
            decided += int((~redo).sum())
            assert torch.equal(apply_sampling_masks(x[rows], k, p, kernels=sampling_kernels), want)
    assert decided >= 5  # the candidates' path ran, not only the full sort


def test_peaked_rows_are_decided_among_candidates_flat_ones_again(sampling_kernels):
    x = torch.randn(4, 5000) * 8  # peaked: top-p 0.9 keeps a handful
    x[2] = 0.0
    x[2, 0] = 1.0  # flat: top-p 0.9 needs thousands of tokens
    *_, redo = sampling_masks._decide_among_candidates(x, None, torch.full((4,), 0.9), sampling_kernels)
    assert redo.tolist() == [False, False, True, False]
    k = torch.tensor([50, 2000, 5000, 1])
    *_, redo = sampling_masks._decide_among_candidates(x, k, None, sampling_kernels)
    assert redo.tolist() == [False, True, False, False]  # k > 1,024; k = V is off
    p = torch.full((4,), 0.9)
    assert sampling_masks._decide_among_candidates(x[:, :1024], None, p, sampling_kernels) is None


def test_the_native_floor_takes_few_candidates_and_refuses_rows_it_cannot_place():
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler on this machine")
    x = torch.randn(7, 32000, generator=torch.Generator().manual_seed(0)) * 4  # top-p 0.9: ~128 tokens
    x[1, 7] = float("nan")  # no order: a full sort decides it (as torch sorts NaN)
    x[2] = float("-inf")  # nothing finite
    x[3, :10] = 40.0  # ten tokens hold the row, the rest 20+ nats below
    x[4, :10] = 40.0  # its top 40 reach far below them
    k = torch.tensor([40, 32000, 32000, 32000, 40, 2000, 40])  # row 5: more than the 1,024 allowed
    p = torch.tensor([1.0, 0.9, 0.9, 0.5, 1.0, 1.0, 1.0])
    active = torch.tensor([True] * 6 + [False])  # row 6: nothing to decide
    vals, ids, found = sampling_masks._native_candidates(kernels, x, k, k < 32000, p, active, 1024)
    assert found[[1, 2, 3, 5, 6]].tolist() == [-1, -1, 10, -1, 0]
    assert 40 <= found[0] <= 1024 and 40 <= found[4] <= 1024
    for r in (0, 3, 4):  # a prefix of the row's descending order, in token order
        n = int(found[r])
        assert torch.equal(ids[r, :n], torch.sort(ids[r, :n]).values)
        assert torch.equal(vals[r, :n], x[r, ids[r, :n]])
        outside = torch.ones(32000, dtype=torch.bool).index_fill_(0, ids[r, :n], False)
        assert vals[r, :n].min() > x[r][outside].max()
        assert (ids[r, n:] == 32000).all() and (vals[r, n:] == float("-inf")).all()
    for how in (kernels, None):  # decided among the candidates, by the floor as by topk
        *_, redo = sampling_masks._decide_among_candidates(x[[0, 3]], k[[0, 3]], p[[0, 3]], how)
        assert redo.tolist() == [False, False]


@pytest.mark.parametrize("seed", range(3))
def test_floor_masks_equal_full_sort_masks_at_a_real_vocabulary(monkeypatch, sampling_kernels, seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0, 30.0]).repeat(4)  # flat .. one token
    x = torch.randn(len(scales), 8000, generator=g) * scales[:, None]
    x[::5] = (x[::5] * 2).round() / 2  # ties at every boundary
    k = torch.tensor([8000, 1, 5, 50, 700, 8000])[torch.randint(0, 6, (len(x),), generator=g)]
    p = torch.tensor([1.0, 0.1, 0.5, 0.9, 0.99])[torch.randint(0, 5, (len(x),), generator=g)]
    decided = 0
    for kk, pp in ((k, None), (None, p), (k, p)):
        want = _full_sort(monkeypatch, x, kk, pp)
        assert torch.equal(apply_sampling_masks(x, kk, pp, kernels=sampling_kernels), want)
        *_, redo = sampling_masks._decide_among_candidates(x, kk, pp, sampling_kernels)
        decided += int((~redo).sum())
    assert decided >= len(x)


def test_rows_too_flat_for_the_first_candidates_are_decided_among_more(monkeypatch):
    """Top-p over flat rows needs thousands of tokens: the native floor's second try takes
    them without sorting the whole row, and its masks are the full sort's."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler on this machine")
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([3.0, 2.5, 8.0, 1.0, 3.0])  # top-p 0.9: ~2,000, ~5,500, few, ~20,000+
    x = torch.randn(len(scales), 49152, generator=g) * scales[:, None]
    x[4] = (x[4] * 2).round() / 2  # ties at every boundary
    p = torch.full((len(x),), 0.9)
    k = torch.tensor([49152, 49152, 49152, 49152, 3000])  # row 4: a top-k past the first try
    for kk, pp in ((None, p), (k, p), (k, None)):
        want = _full_sort(monkeypatch, x, kk, pp)
        sorted_rows = []
        full_sort = sampling_masks._full_sort_mask
        monkeypatch.setattr(sampling_masks, "_full_sort_mask",
                            lambda rows, *a: sorted_rows.append(len(rows)) or full_sort(rows, *a))
        assert torch.equal(apply_sampling_masks(x, kk, pp, kernels=kernels), want)
        monkeypatch.undo()
        assert sum(sorted_rows) <= (1 if pp is not None else 0), "only the flattest row sorted whole"
