"""The request path's per-step / per-token split (`tandem bench request-path`, `plan --validate`)."""

from __future__ import annotations

import pytest

from tandem.bench.server_cpu import fit_per_step_and_token as fit


def test_fit_separates_the_cost_per_step_from_the_cost_per_token():
    # batches of 1, 4 and 16 streams of 128 tokens: 128 steps each (one token per stream per
    # step), 2 ms a step and 0.5 ms a token
    points = [(128.0, 128 * n, 128 * 0.002 + 128 * n * 0.0005) for n in (1, 4, 16)]
    assert fit(points) == pytest.approx((0.002, 0.0005))


def test_fit_needs_two_ratios_and_never_goes_negative():
    with pytest.raises(ValueError, match="two ratios"):
        fit([(128.0, 128, 0.3)] * 3)
    with pytest.raises(ValueError, match="two ratios"):  # twice as many steps and tokens: no split either
        fit([(128.0, 128, 0.3), (256.0, 256, 0.6)])
    # more CPU per token at the larger batch than a positive per-step cost allows: per step 0
    per_step, per_token = fit([(100.0, 100, 0.01), (100.0, 1000, 1.0)])
    assert per_step == 0.0 and per_token > 0
