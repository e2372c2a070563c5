"""The packed step buffer of the CUDA path and the decode-graph buckets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.engine.decode_graphs import BUCKETS, bucket_for, buckets_up_to
from tandem.engine.varlen_inputs import VarlenInputs, VarlenLayout, fill

# two sequences: a 3-token prefill chunk from position 4 (blocks 7, 2) and a decode
# at position 9 (blocks 5, 1, 6), block size 4
ENTRIES = [(0, 4, 3, [7, 2]), (3, 9, 1, [5, 1, 6])]
IDS = [11, 12, 13, 14]
POSITIONS = [4, 5, 6, 9]
SLOTS = [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 6 * 4 + 1]


def test_build_packs_one_buffer_and_views_it():
    step = VarlenInputs(torch.device("cpu"), block_size=4).build(
        ENTRIES, IDS, POSITIONS, SLOTS, sample_rows=[2, 3], max_query_len=3)
    assert step.input_ids.tolist() == IDS and step.positions.tolist() == POSITIONS
    assert step.meta.slot_mapping.tolist() == SLOTS
    batch = step.meta.varlen
    assert batch.query_start.tolist() == [0, 3, 4]
    assert batch.context_len.tolist() == [7, 10]
    assert batch.block_table.tolist() == [[7, 2, 0], [5, 1, 6]]
    assert batch.max_query_len == 3
    assert step.sample_index.tolist() == [2, 3]
    base = step.input_ids.untyped_storage().data_ptr()  # one buffer behind every tensor
    for t in (step.positions, batch.query_start, batch.block_table, step.sample_index):
        assert t.untyped_storage().data_ptr() == base


def test_padding_rows_write_no_kv_and_have_no_context():
    layout = VarlenLayout(num_tokens=4, num_seqs=4, max_blocks=3, num_samples=4)
    host = np.full(layout.size + 5, 99, dtype=np.int64)  # a larger, dirty staging buffer
    decodes = [(0, 9, 1, [5, 1, 6]), (1, 2, 1, [3])]
    fill(host, layout, decodes, [14, 15], [9, 2], [25, 14], [0, 1], block_size=4)
    ids, pos, slots, starts, ctx, table, sample = (
        p.tolist() for p in layout.split(torch.from_numpy(host)))
    assert ids == [14, 15, 0, 0] and pos == [9, 2, 0, 0]
    assert slots == [25, 14, -1, -1]
    assert starts == [0, 1, 2, 3, 4]  # one query row per padding sequence
    assert ctx == [10, 3, 0, 0]
    assert table == [5, 1, 6, 3, 0, 0, 0, 0, 0, 0, 0, 0]
    assert sample == [0, 1, 2, 3]


def test_a_step_that_does_not_fit_is_refused():
    layout = VarlenLayout(num_tokens=2, num_seqs=2, max_blocks=1, num_samples=2)
    host = np.zeros(layout.size, dtype=np.int64)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        fill(host, layout, [(0, 9, 1, [5, 1, 6])], [1], [9], [25], [0], block_size=4)
    with pytest.raises(ValueError, match="does not fit"):
        fill(host, layout, ENTRIES, IDS, POSITIONS, SLOTS, [3], block_size=4)


def test_buckets():
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(20) == (1, 2, 4, 8, 16, 20)
    assert buckets_up_to(64)[-1] == 64
    assert buckets_up_to(10_000) == BUCKETS  # bigger decode batches run eagerly
    assert bucket_for(3, buckets_up_to(20)) == 4
    assert bucket_for(17, buckets_up_to(20)) == 20
    assert bucket_for(21, buckets_up_to(20)) is None
    with pytest.raises(ValueError):
        buckets_up_to(0)
