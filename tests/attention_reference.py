"""Attention of query runs over a paged cache, computed plainly (gather + masked SDPA):
what the native CPU kernels are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_prefill(q, k_cache, v_cache, table, first_row, start, n, window, scale):
    """Per sequence: gather its blocks, then masked SDPA of its query run."""
    bs = k_cache.shape[1]
    outs = []
    for s in range(len(first_row)):
        pos = start[s] + torch.arange(n[s])  # [n]
        keys = torch.arange(table.shape[1] * bs)
        mask = keys[None, :] <= pos[:, None]
        if window:
            mask &= keys[None, :] > pos[:, None] - window
        kg = k_cache[table[s]].flatten(0, 1).transpose(0, 1).float()  # [KVH, K, D]
        vg = v_cache[table[s]].flatten(0, 1).transpose(0, 1).float()
        qs = q[first_row[s]:first_row[s] + n[s]].transpose(0, 1)  # [H, n, D]
        o = F.scaled_dot_product_attention(qs[None], kg[None], vg[None], attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=True)[0]
        outs.append(o.transpose(0, 1))
    return outs
