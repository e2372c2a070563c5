"""The prompt-token rate an engine publishes for the router's prefill decisions."""

from __future__ import annotations

import pytest

from tandem.engine.prefill_rate import PrefillRate


def test_no_rate_until_a_prompt_step_was_observed():
    rate = PrefillRate()
    assert rate.tokens_per_s() == 0.0
    rate.observe(0, 0.03)  # a decode-only step
    rate.observe(100, 0.0)  # no measurable time
    assert rate.tokens_per_s() == 0.0
    rate.observe(512, 0.25)
    assert rate.tokens_per_s() == pytest.approx(2048.0)


def test_a_step_counts_by_its_length_not_once_each():
    """Short steps at a worse rate weigh by their tokens and seconds, as a ratio of sums."""
    rate = PrefillRate(decay=0.5)
    rate.observe(1000, 1.0)
    rate.observe(10, 0.1)  # 100 tok/s, but a tenth of a second
    # (0.5*1000*0.5 + 0.5*10) / (0.5*1.0*0.5 + 0.5*0.1) = 255 / 0.3
    assert rate.tokens_per_s() == pytest.approx(850.0)


def test_follows_a_change_of_speed_within_a_dozen_steps():
    rate = PrefillRate()
    for _ in range(20):
        rate.observe(512, 0.5)  # 1,024 tok/s
    for _ in range(12):
        rate.observe(512, 0.25)  # the CPU freed: 2,048 tok/s
    assert 1900.0 < rate.tokens_per_s() < 2048.0


def test_each_thread_count_keeps_its_own_rate():
    """A worker that bursts to 2 threads while idle must not publish its burst rate once
    load brings it back to 1: it reads the rate of the count in force."""
    rate = PrefillRate()
    rate.observe(1024, 1.0, threads=1)
    rate.observe(1024, 0.5, threads=2)
    assert rate.tokens_per_s(1) == pytest.approx(1024.0)
    assert rate.tokens_per_s(2) == pytest.approx(2048.0)
    # a count never measured reads the last one measured
    assert rate.tokens_per_s(4) == pytest.approx(2048.0)


@pytest.mark.parametrize("decay", [-0.1, 1.0, float("nan")])
def test_decay_must_be_in_the_unit_interval(decay):
    with pytest.raises(ValueError, match="decay"):
        PrefillRate(decay)
