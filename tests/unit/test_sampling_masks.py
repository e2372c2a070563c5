"""Top-k/top-p decided among each row's largest logits gives the full sort's masks."""

from __future__ import annotations

import pytest
import torch

from services.engine import sampling_masks
from services.engine.sampling_masks import apply_sampling_masks


def _full_sort(monkeypatch, *args):
    monkeypatch.setattr(sampling_masks, "_candidate_mask", lambda *a: None)
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
def test_candidate_masks_equal_full_sort_masks(monkeypatch, seed, candidates):
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
            _, redo = sampling_masks._candidate_mask(
                x[rows], None if k is None else k.clamp(1, vocab), p)
            decided += int((~redo).sum())
            assert torch.equal(apply_sampling_masks(x[rows], k, p), want)
    assert decided >= 5  # the candidates' path ran, not only the full sort


def test_peaked_rows_are_decided_among_candidates_flat_ones_again():
    x = torch.randn(4, 5000) * 8  # peaked: top-p 0.9 keeps a handful
    x[2] = 0.0
    x[2, 0] = 1.0  # flat: top-p 0.9 needs thousands of tokens
    _, redo = sampling_masks._candidate_mask(x, None, torch.full((4,), 0.9))
    assert redo.tolist() == [False, False, True, False]
    _, redo = sampling_masks._candidate_mask(x, torch.tensor([50, 2000, 5000, 1]), None)
    assert redo.tolist() == [False, True, False, False]  # k > 1,024; k = V is off
    assert sampling_masks._candidate_mask(x[:, :1024], None, torch.full((4,), 0.9)) is None
