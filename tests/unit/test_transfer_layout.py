"""Zero-copy layout planning: runs consecutive on both sides, and the message plan."""

from __future__ import annotations

import pytest

from tandem.transfer.layout import (MAX_SEGMENTS, MIN_RUN_PLANE_BYTES, common_runs, messages,
                                      runs_fit, zero_copy_segments)


def test_runs_break_where_either_side_jumps():
    assert common_runs([4, 5, 6, 7], [10, 11, 12, 13]) == [4]
    assert common_runs([4, 5, 6, 7], [10, 11, 20, 21]) == [2, 2]  # dst jumps
    assert common_runs([4, 9, 10, 11], [0, 1, 2, 3]) == [1, 3]  # src jumps
    assert common_runs([3, 2, 1], [0, 1, 2]) == [1, 1, 1]  # descending is not a run
    assert common_runs([], []) == []
    with pytest.raises(ValueError, match="3 source blocks but 2"):
        common_runs([1, 2, 3], [1, 2])


def test_few_long_runs_go_in_place_many_or_small_ones_are_gathered():
    big = MIN_RUN_PLANE_BYTES  # one block per plane is already a full run's worth
    assert zero_copy_segments(list(range(8)), list(range(100, 108)), big) == (8,)
    assert zero_copy_segments([0, 1, 5, 6], [0, 1, 2, 3], big) == (2, 2)
    assert zero_copy_segments(list(range(8)), list(range(8)), big // 16) == ()  # runs too small
    scattered = list(range(0, 2 * (MAX_SEGMENTS + 1), 2))
    assert zero_copy_segments(scattered, list(range(len(scattered))), big) == ()  # too many runs
    assert zero_copy_segments([], [], big) == ()


def test_runs_fit_checks_cover_and_consecutiveness():
    assert runs_fit([7, 8, 9, 2, 3], (3, 2))
    assert not runs_fit([7, 8, 9, 2, 3], (2, 3))  # 9 -> 2 inside the second run
    assert not runs_fit([7, 8, 9], (2,))  # does not cover
    assert not runs_fit([7, 8], (2, 1))


def test_message_plan_is_layer_then_kv_then_run_and_derivable_from_the_header():
    plane = 1024
    plan = messages(2 * 2 * 5 * plane, (3, 2), plane)  # 2 layers, K|V, runs of 3 and 2
    assert plan == [(0, 0, 0, 3), (0, 0, 3, 2), (0, 1, 0, 3), (0, 1, 3, 2),
                    (1, 0, 0, 3), (1, 0, 3, 2), (1, 1, 0, 3), (1, 1, 3, 2)]
    assert sum(n for *_, n in plan) * plane == 2 * 2 * 5 * plane
    with pytest.raises(ValueError, match="not whole layers"):
        messages(2 * 5 * plane + 1, (3, 2), plane)
