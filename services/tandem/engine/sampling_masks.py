"""Top-k, top-p and min-p masks over a step's temperature-scaled logits.

Top-k and top-p are decided in the rows' stable descending order (ties by
token id). A full sort of a vocabulary-wide row is costly on a CPU, so the
decision is first made among a few candidates of each row, a prefix of that
order: on CPU the tokens above a floor the native kernel places per row without
sorting it (``csrc/top_candidates.c``: enough tokens for the row's top-k, or
enough of its mass for its top-p); elsewhere the row's ``CANDIDATES`` largest
logits (``topk``). The candidates are stably re-sorted, and the decision among
them is the full sort's where every token outside is sure to be dropped: among
``topk``'s, where no kept token ties the smallest candidate; above the floor,
where the k-th largest is a candidate or the candidates' mass reaches past
top-p (every token outside lies below all of them, their mass ahead of it). The
rows where that does not hold (a flat distribution, a top-k beyond the
candidates) are decided again: on CPU first above the floor among up to
``WIDE_CANDIDATES``, then, for the rows still open, over full sorts; every way
gives the same masks.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.kernels.cpu_kernels import CpuKernels

# Cumulative mass within this of top_p counts as reaching it (float32 noise).
_TOP_P_EPS = 1e-6
CANDIDATES = 1024  # at most this many candidates per row (topk: exactly this many)
# The native floor's second try, for the rows the first could not decide: a flat row's
# top-p needs thousands of tokens (SmolLM2 after random prompts, temperature 0.8, top-p
# 0.9: 1,200-7,700 of 49,152), whose sort costs a fraction of the whole row's.
WIDE_CANDIDATES = 8192
# The native floor asks for this much more mass than top-p, so that the candidates' mass
# summed again in torch's arithmetic (the check) still reaches past it.
_FLOOR_MARGIN = 1e-4


def apply_sampling_masks(logits: torch.Tensor, top_k: torch.Tensor | None = None,
                         top_p: torch.Tensor | None = None,
                         min_p: torch.Tensor | None = None,
                         kernels: CpuKernels | None = None) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, then top-p, then min-p, per row.

    ``logits`` [B, V] (already temperature-scaled); ``top_k`` [B] long (>= V is
    off), ``top_p`` [B] (1.0 is off), ``min_p`` [B] (0.0 is off). Top-k keeps
    ties with the k-th value (as HF/vLLM). Top-p keeps the smallest set of most
    probable tokens whose mass reaches top_p (renormalised after top-k); the
    top token always survives. ``kernels``: the native CPU kernels, which pick
    the candidates of contiguous fp32 CPU rows (the same masks, sooner).
    """
    neg_inf = float("-inf")
    if top_k is not None or top_p is not None:
        vocab = logits.shape[1]
        k = None if top_k is None else top_k.to(logits.device).clamp(1, vocab)  # [B]
        p = None if top_p is None else top_p.to(logits.device, logits.dtype)  # [B]
        logits = _top_k_top_p(logits.contiguous(), k, p, kernels)
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        thr = probs.amax(dim=-1, keepdim=True) * min_p.to(logits.device, logits.dtype)[:, None]  # [B, 1]
        logits = logits.masked_fill(probs < thr, neg_inf)
    return logits


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                 kernels: CpuKernels | None) -> torch.Tensor:
    """``logits`` [B, V] with the tokens outside each row's top-k and top-p at -inf."""
    decided = _decide_among_candidates(logits, k, p, kernels)
    if decided is None:
        return logits.masked_fill(~_full_sort_mask(logits, k, p), float("-inf"))
    kept, active, redo = decided
    out = torch.full_like(logits, float("-inf"))  # [B, V]
    out.view(-1)[kept] = logits.view(-1)[kept]
    if not bool(active.all()):
        out[~active] = logits[~active]
    rows = redo.nonzero().squeeze(1)  # [R] rows still to decide
    if rows.numel() and kernels is not None:  # a second try among more candidates
        sub = logits[rows]  # [R, V]
        k_sub, p_sub = None if k is None else k[rows], None if p is None else p[rows]
        decided = _decide_among_candidates(sub, k_sub, p_sub, kernels, WIDE_CANDIDATES)
        if decided is not None:
            kept, _, redo = decided  # every row here has a mask
            out[rows[kept // sub.shape[1]], kept % sub.shape[1]] = sub.view(-1)[kept]
            rows = rows[redo]
    if rows.numel():
        mask = _full_sort_mask(logits[rows], None if k is None else k[rows],
                               None if p is None else p[rows])
        out[rows] = logits[rows].masked_fill(~mask, float("-inf"))
    return out


def _sorted_keep(logits: torch.Tensor, srt: torch.Tensor, kth: torch.Tensor | None,
                 p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which of ``srt`` [B, C] survive top-k and top-p: the first C of each row of
    ``logits`` [B, V] in stable descending order (C <= V; all of it, or its
    candidates); ``kth`` [B, 1] the k-th largest value of each row (-inf: no top-k).
    Returns [B, C] bool, in ``srt``'s order, and with top-p the [B, C] mass through
    each of them (top-p's cumulative sum; None without)."""
    keep = torch.ones_like(srt, dtype=torch.bool)  # [B, C]
    lse = None
    if kth is not None:
        keep = srt >= kth
        if p is not None:  # top-p's mass is renormalised over the row's top-k
            lse = torch.logsumexp(logits.masked_fill(logits < kth, float("-inf")), dim=-1)  # [B]
    if p is None:
        return keep, None
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)  # [B]
    probs = torch.exp(srt - lse[:, None]).masked_fill_(~keep, 0.0)  # [B, C]
    through = probs.cumsum(dim=-1)  # [B, C]
    thr = _top_p_threshold(p)  # [B]
    keep = keep & (through - probs < thr[:, None])  # the mass strictly ahead
    keep[:, 0] = True
    return keep, through


def _top_p_threshold(p: torch.Tensor) -> torch.Tensor:
    """[B]: the mass ahead of a token below which top-p keeps it (inf: top-p off)."""
    return torch.where(p >= 1.0, torch.full_like(p, float("inf")), p - _TOP_P_EPS)


def _full_sort_mask(logits: torch.Tensor, k: torch.Tensor | None,
                    p: torch.Tensor | None) -> torch.Tensor:
    """The [B, V] keep mask decided over each row's full stable sort."""
    srt, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    kth = None if k is None else srt.gather(1, (k - 1)[:, None])  # [B, 1]
    keep, _ = _sorted_keep(logits, srt, kth, p)
    return torch.empty_like(srt, dtype=torch.bool).scatter_(1, order, keep)


def _decide_among_candidates(
        logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
        kernels: CpuKernels | None = None, cap: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Top-k and top-p decided among each row's candidates, at most ``cap`` of them
    (default ``CANDIDATES``; see the module docstring): [N] the kept tokens as indices
    into the flattened ``logits`` [B, V] (contiguous), [B] bool the rows with a top-k or
    top-p, and [B] bool the rows where the candidates' decision is not exact (to decide
    again); None when the vocabulary is no larger than ``cap``."""
    bsz, vocab = logits.shape
    c = CANDIDATES if cap is None else cap
    if vocab <= c:
        return None
    dev = logits.device
    active = torch.zeros(bsz, dtype=torch.bool, device=dev)  # rows with a mask
    on = None if k is None else k < vocab  # [B] rows with a top-k
    if on is not None:
        active |= on
    if p is not None:
        active |= p < 1.0
    if kernels is not None and dev.type == "cpu" and logits.dtype == torch.float32:
        vals, ids, found = _native_candidates(kernels, logits, k, on, p, active, c)
        c = max(int(found.max()), 1)  # the widest row's candidates; padding past them
        vals, ids = vals[:, :c], ids[:, :c]
    else:
        vals, ids = logits.topk(c, dim=-1)  # [B, c]: the right values, ties in any order
        ids, by_id = ids.sort(dim=-1)  # [B, c] ascending ids
        vals = vals.gather(1, by_id)
        found = None
    srt, order = vals.sort(dim=-1, descending=True, stable=True)  # [B, c]
    ids = ids.gather(1, order)  # [B, c] token ids in the rows' stable descending order
    beyond = torch.zeros_like(active)  # rows whose k-th value is not a candidate
    kth = None
    if k is not None:
        beyond = on & (k > (c if found is None else found))  # (the row is redone)
        kth = srt.gather(1, (k.clamp(max=c) - 1)[:, None]).masked_fill_(~on[:, None], float("-inf"))
    keep, through = _sorted_keep(logits, srt, kth, p)  # [B, c]
    if found is None:  # topk: tokens outside may tie the last candidate
        redo = beyond | ((keep & ~(srt > srt[:, -1:])).any(dim=-1) & active)  # [B]
    else:  # the floor: every token outside lies below all candidates, their mass ahead
        exact = on & ~beyond if on is not None else torch.zeros_like(active)  # top-k excludes them
        if through is not None:  # top-p excludes them (+ eps: the rounding of their mass ahead)
            mass = through.gather(1, (found - 1).clamp(min=0)[:, None]).squeeze(1)  # [B]
            exact |= (p < 1.0) & (mass >= _top_p_threshold(p) + _TOP_P_EPS)
        redo = (found < 0) | (active & ~exact)
        keep &= torch.arange(c) < found[:, None]  # the padding (id V) kept nowhere
    kept = (torch.arange(bsz, device=dev)[:, None] * vocab + ids)[keep & active[:, None]]  # [N]
    return kept, active, redo


def _native_candidates(kernels: CpuKernels, logits: torch.Tensor, k: torch.Tensor | None,
                       on: torch.Tensor | None, p: torch.Tensor | None, active: torch.Tensor,
                       cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each active row's candidates by the native floor: ``[B, cap]`` values and ids in
    token order (padded with -inf and id V) and ``[B]`` how many (-1: the row is decided
    over a full sort)."""
    bsz, vocab = logits.shape
    # a row with a top-k needs its k largest (they decide it); one with only a top-p, its mass
    need_count = torch.zeros(bsz, dtype=torch.long) if k is None else torch.where(on, k, 0)  # [B]
    need_mass = torch.zeros(bsz) if p is None else \
        torch.where((p < 1.0) & (need_count == 0), (p.float() + _FLOOR_MARGIN).clamp(max=1.0), 0.0)
    need_count = need_count.masked_fill(~active, -1).contiguous()  # [B] (-1: no candidates)
    need_mass = need_mass.contiguous()  # [B]
    vals = torch.empty(bsz, cap)
    ids = torch.empty(bsz, cap, dtype=torch.long)
    found = torch.empty(bsz, dtype=torch.long)
    if _floor_kernel(kernels.lib)(logits.data_ptr(), bsz, vocab, need_mass.data_ptr(),
                                  need_count.data_ptr(), cap, vals.data_ptr(), ids.data_ptr(),
                                  found.data_ptr()) != 0:
        found.fill_(-1)  # no scratch row: every row over a full sort
    return vals, ids, found


@cache
def _floor_kernel(lib: ctypes.CDLL):
    fn = lib.tandem_top_candidates_f32
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr]
    return fn
