"""Top-k, top-p and min-p masks over a step's temperature-scaled logits.

Top-k and top-p are decided in the rows' stable descending order (ties by
token id). A full sort of a 32,000-token row costs ~1.3 ms on a CPU, so the
decision is first made among each row's ``CANDIDATES`` largest logits
(``topk``, then a stable re-sort of those few): exact wherever the kept tokens
all lie strictly above the smallest candidate, since every token above it is a
candidate and so in its full-sort place. The rows where that does not hold (a
flat distribution, a top-k beyond the candidates) are decided again over full
sorts; the two give the same masks.
"""

from __future__ import annotations

import torch

# Cumulative mass within this of top_p counts as reaching it (float32 noise).
_TOP_P_EPS = 1e-6
CANDIDATES = 1024  # a row's largest logits the masks are first decided among


def apply_sampling_masks(logits: torch.Tensor, top_k: torch.Tensor | None = None,
                         top_p: torch.Tensor | None = None,
                         min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, then top-p, then min-p, per row.

    ``logits`` [B, V] (already temperature-scaled); ``top_k`` [B] long (>= V is
    off), ``top_p`` [B] (1.0 is off), ``min_p`` [B] (0.0 is off). Top-k keeps
    ties with the k-th value (as HF/vLLM). Top-p keeps the smallest set of most
    probable tokens whose mass reaches top_p (renormalised after top-k); the
    top token always survives.
    """
    neg_inf = float("-inf")
    if top_k is not None or top_p is not None:
        vocab = logits.shape[1]
        k = None if top_k is None else top_k.to(logits.device).clamp(1, vocab)  # [B]
        p = None if top_p is None else top_p.to(logits.device, logits.dtype)  # [B]
        found = _candidate_mask(logits, k, p)
        if found is None:
            mask = _full_sort_mask(logits, k, p)
        else:
            mask, redo = found
            if bool(redo.any()):
                rows = redo.nonzero().squeeze(1)  # [R]
                mask[rows] = _full_sort_mask(logits[rows], None if k is None else k[rows],
                                             None if p is None else p[rows])
        logits = logits.masked_fill(~mask, neg_inf)
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        thr = probs.amax(dim=-1, keepdim=True) * min_p.to(logits.device, logits.dtype)[:, None]  # [B, 1]
        logits = logits.masked_fill(probs < thr, neg_inf)
    return logits


def _sorted_keep(logits: torch.Tensor, srt: torch.Tensor, kth: torch.Tensor | None,
                 p: torch.Tensor | None) -> torch.Tensor:
    """Which of ``srt`` [B, C] survive top-k and top-p: the first C of each row of
    ``logits`` [B, V] in stable descending order (C <= V; all of it, or its
    candidates); ``kth`` [B, 1] the k-th largest value of each row (-inf: no top-k).
    Returns [B, C] bool, in ``srt``'s order."""
    keep = torch.ones_like(srt, dtype=torch.bool)  # [B, C]
    lse = None
    if kth is not None:
        keep = srt >= kth
        if p is not None:  # top-p's mass is renormalised over the row's top-k
            lse = torch.logsumexp(logits.masked_fill(logits < kth, float("-inf")), dim=-1)  # [B]
    if p is not None:
        if lse is None:
            lse = torch.logsumexp(logits, dim=-1)  # [B]
        probs = torch.exp(srt - lse[:, None]).masked_fill_(~keep, 0.0)  # [B, C]
        before = probs.cumsum(dim=-1) - probs  # [B, C] mass strictly ahead
        thr = torch.where(p >= 1.0, torch.full_like(p, float("inf")), p - _TOP_P_EPS)  # [B]
        keep = keep & (before < thr[:, None])
        keep[:, 0] = True
    return keep


def _full_sort_mask(logits: torch.Tensor, k: torch.Tensor | None,
                    p: torch.Tensor | None) -> torch.Tensor:
    """The [B, V] keep mask decided over each row's full stable sort."""
    srt, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    kth = None if k is None else srt.gather(1, (k - 1)[:, None])  # [B, 1]
    return torch.empty_like(srt, dtype=torch.bool).scatter_(1, order, _sorted_keep(logits, srt, kth, p))


def _candidate_mask(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The [B, V] keep mask decided among each row's ``CANDIDATES`` largest logits and
    [B] bool, the rows where that is not exact (to decide again); None when the
    vocabulary is no larger than the candidates."""
    bsz, vocab = logits.shape
    c = CANDIDATES
    if vocab <= c:
        return None
    vals, ids = logits.topk(c, dim=-1)  # [B, c]: the right values, ties in any order
    ids, by_id = ids.sort(dim=-1)  # [B, c] ascending ids
    srt, order = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)  # [B, c]
    ids = ids.gather(1, order)  # [B, c] token ids in the rows' stable descending order
    active = torch.zeros(bsz, dtype=torch.bool, device=logits.device)  # rows with a mask
    beyond = torch.zeros_like(active)  # rows whose k-th value is not a candidate
    kth = None
    if k is not None:
        on = k < vocab  # [B]
        beyond = on & (k > c)  # (the last candidate stands in for it; the row is redone)
        kth = srt.gather(1, (k.clamp(max=c) - 1)[:, None]).masked_fill_(~on[:, None], float("-inf"))
        active |= on
    if p is not None:
        active |= p < 1.0
    keep = _sorted_keep(logits, srt, kth, p)  # [B, c]
    above_floor = srt > srt[:, -1:]  # [B, c] placed as in the full sort
    redo = beyond | ((keep & ~above_floor).any(dim=-1) & active)  # [B]
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, keep)  # [B, V]
    mask[~active] = True
    return mask, redo
