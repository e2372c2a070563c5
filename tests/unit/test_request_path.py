"""The request path's per-step / per-token split of `tandem bench request-path`."""

from __future__ import annotations

import pytest

from services.bench.request_path import Batch, fit


def test_fit_separates_the_cost_per_step_from_the_cost_per_token():
    # batches of 1, 4 and 16 streams of 128 tokens: 128 steps each (one token per stream per
    # step), 2 ms a step and 0.5 ms a token
    batches = [Batch(n, 128 * n, 128.0, 128 * 0.002 + 128 * n * 0.0005, 1.0) for n in (1, 4, 16)]
    assert fit(batches) == pytest.approx((0.002, 0.0005))


def test_fit_needs_two_shapes_and_never_goes_negative():
    with pytest.raises(ValueError, match="two shapes"):
        fit([Batch(1, 128, 128.0, 0.3, 1.0)] * 3)
    # more CPU per token at the larger batch than a positive per-step cost allows: per step 0
    per_step, per_token = fit([Batch(1, 100, 100.0, 0.01, 1.0), Batch(10, 1000, 100.0, 1.0, 1.0)])
    assert per_step == 0.0 and per_token > 0
