"""Attention groups of a step on the torch backend: entries padded to one query length.

An entry is ``(flat offset, cursor, n new, block ids)``: the sequence's first query row
in the step's flat batch, its first position, how many query rows it has, its blocks.
"""

from __future__ import annotations

import torch

from tandem.engine.model.attention import AttentionGroup
from tandem.engine.varlen_inputs import Entry


def build_group(entries: list[Entry], block_size: int, sliding_window: int | None,
                device: torch.device, prompt: bool) -> AttentionGroup | None:
    """Pad ``entries`` into one attention group (``prompt``: of prompt chunks); None if
    there are none."""
    if not entries:
        return None
    bs = block_size
    q_len = max(e[2] for e in entries)
    max_blocks = max(-(-(e[1] + e[2]) // bs) for e in entries)
    pad = [0] * max_blocks
    table = torch.tensor([(e[3][:-(-(e[1] + e[2]) // bs)] + pad)[:max_blocks]
                          for e in entries], dtype=torch.long)  # one copy, not one per row
    if q_len == 1:
        return _decode_group(entries, table, bs, sliding_window, device, prompt)
    offsets = torch.tensor([e[0] for e in entries])  # [B]
    starts = torch.tensor([e[1] for e in entries])
    lens = torch.tensor([e[2] for e in entries])
    i = torch.arange(q_len)
    valid = i[None, :] < lens[:, None]  # [B, Q]
    token_index = torch.where(valid, offsets[:, None] + i[None, :], 0)
    q_pos = starts[:, None] + torch.minimum(i[None, :], lens[:, None] - 1)  # [B, Q]
    all_valid = bool(valid.all())
    # whole prompts of one length from position 0: plain causal attention, no mask
    causal = all_valid and not bool(starts.any()) and (
        sliding_window is None or sliding_window >= q_len)
    mask = None
    if not causal:
        mask = _mask(q_pos, max_blocks * bs, sliding_window).unsqueeze(1).to(device)
    return AttentionGroup(
        token_index=token_index.to(device),
        valid_flat=None if all_valid else valid.flatten().nonzero().squeeze(1).to(device),
        token_rows=token_index[valid].to(device),
        block_table=table.to(device),
        last_pos=(starts + lens - 1).to(device),
        mask=mask,
        first_row=offsets.to(device),
        first_pos=starts.to(device),
        query_len=lens.to(device), prompt=prompt)


def _decode_group(entries: list[Entry], table: torch.Tensor, bs: int,
                  sliding_window: int | None, device: torch.device, prompt: bool) -> AttentionGroup:
    """``build_group`` where every entry has one query row (what a decode step has): the
    same tensors from fewer ops, since a host step's small ops dominate its overhead."""
    rows = torch.tensor([[e[0] for e in entries], [e[1] for e in entries], [1] * len(entries)])
    offsets, starts, ones = rows  # [B] each: flat row, position (= last position), 1
    mask = _mask(starts[:, None], table.shape[1] * bs, sliding_window)  # [B, 1, K]
    return AttentionGroup(
        token_index=offsets[:, None].to(device), valid_flat=None, token_rows=offsets.to(device),
        block_table=table.to(device), last_pos=starts.to(device), mask=mask.unsqueeze(1).to(device),
        first_row=offsets.to(device), first_pos=starts.to(device), query_len=ones.to(device),
        prompt=prompt)


def _mask(q_pos: torch.Tensor, keys: int, sliding_window: int | None) -> torch.Tensor:
    """``[B, Q, keys]`` bool: query at ``q_pos [B, Q]`` may attend to key position k."""
    k_pos = torch.arange(keys)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask


def same_shape(chunks: list[Entry]) -> list[list[Entry]]:
    """Prefill chunks split into groups of one length and start: a padded group would
    compute a short prompt's attention at its longest member's length (a 32-token prompt
    beside a 1,024-token one: 32x its work), and whole prompts of one length batch
    causally without a mask. One-token chunks (prompts the prefix cache held but their
    last token) form one group whatever their cursors, as decode rows do."""
    by_shape: dict[tuple[int, int], list[Entry]] = {}
    for e in chunks:
        key = (e[1], e[2]) if e[2] > 1 else (-1, 1)  # (cursor, new tokens)
        by_shape.setdefault(key, []).append(e)
    return list(by_shape.values())
