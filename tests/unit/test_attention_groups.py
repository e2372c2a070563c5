"""Attention groups of the torch backend against their definition, element by element:
decode groups (their own short path) and padded groups of several query lengths."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention_groups import build_group, same_shape
from tandem.engine.model.attention import AttentionMetadata

BS = 4
CPU = torch.device("cpu")


def expected(entries, window):
    """Every field of the group, from the entries by the definitions in AttentionGroup."""
    q_len = max(e[2] for e in entries)
    max_blocks = max(-(-(e[1] + e[2]) // BS) for e in entries)
    table, index, valid, mask = [], [], [], []
    for off, start, n, blocks in entries:
        used = blocks[:-(-(start + n) // BS)]
        table.append(used + [0] * (max_blocks - len(used)))
        index.append([off + i if i < n else 0 for i in range(q_len)])
        valid.append([i < n for i in range(q_len)])
        q_pos = [start + min(i, n - 1) for i in range(q_len)]
        mask.append([[k <= q and (window is None or k > q - window) for k in range(max_blocks * BS)]
                     for q in q_pos])
    rows = [off + i for off, _, n, _ in entries for i in range(n)]
    return dict(token_index=index, token_rows=rows, block_table=table,
                last_pos=[s + n - 1 for _, s, n, _ in entries], first_row=[e[0] for e in entries],
                first_pos=[e[1] for e in entries], query_len=[e[2] for e in entries],
                mask=[[m] for m in mask], valid=[v for row in valid for v in row])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("entries", [
    [(0, 9, 1, [7, 2, 5])],  # one decode row
    [(0, 9, 1, [7, 2, 5, 1]), (1, 0, 1, [3]), (2, 4, 1, [6, 0]), (3, 15, 1, [1, 2, 3, 4, 8])],
    [(0, 5, 3, [7, 2, 5]), (3, 0, 1, [4]), (4, 8, 2, [1, 2, 3])],  # padded: lengths 3, 1, 2
])
@pytest.mark.parametrize("prompt", [True, False])
def test_groups_match_their_definition(entries, window, prompt) -> None:
    g = build_group(entries, BS, window, CPU, prompt)
    assert g.prompt is prompt
    want = expected(entries, window)
    for name in ("token_index", "token_rows", "block_table", "last_pos", "first_row", "first_pos",
                 "query_len"):
        got = getattr(g, name)
        assert got.dtype == torch.long and got.tolist() == want[name], name
    assert g.mask.tolist() == want["mask"]
    if all(want["valid"]):
        assert g.valid_flat is None
    else:
        assert g.valid_flat.tolist() == [i for i, v in enumerate(want["valid"]) if v]
    for t in (g.token_rows, g.last_pos, g.block_table):  # what the native kernels read
        assert t.is_contiguous()


def test_whole_prompts_from_position_zero_are_causal_without_a_mask() -> None:
    entries = [(0, 0, 3, [1]), (3, 0, 3, [2])]
    assert build_group(entries, BS, None, CPU, prompt=True).mask is None
    # the window cuts into the prompt
    assert build_group(entries, BS, 2, CPU, prompt=True).mask is not None
    assert build_group([], BS, None, CPU, prompt=True) is None


def test_chunks_group_by_cursor_and_length() -> None:
    a, b, c = (0, 0, 3, [1]), (3, 4, 3, [2, 3]), (6, 0, 3, [4])
    assert same_shape([a, b, c]) == [[a, c], [b]]
    d, e = (9, 33, 1, [5, 6, 7]), (10, 17, 1, [8, 9])  # one-token chunks: one group
    assert same_shape([a, d, b, e]) == [[a], [d, e], [b]]


def test_a_one_row_prompt_group_is_not_a_decode_step() -> None:
    """The torch path's pure-decode shortcut (and the fp32 decode math) is for decode rows:
    a prompt's one-token chunk (a prefix-cache hit's last row) keeps the prompt kernels."""
    entries = [(0, 40, 1, [3, 4, 5])]
    decode, prompt = (build_group(entries, BS, None, CPU, p) for p in (False, True))
    assert AttentionMetadata(slot_mapping=torch.tensor([0]), groups=[decode]).decode_group() is decode
    assert AttentionMetadata(slot_mapping=torch.tensor([0]), groups=[prompt]).decode_group() is None
