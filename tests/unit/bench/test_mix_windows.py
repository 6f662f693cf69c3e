"""`bench mix`'s windowed total-variation distance and its producer speeds."""

from __future__ import annotations

import pytest

from dflash_train.bench.mix import producer_rates, windowed_tv

HALVES = {0: 0.5, 1: 0.5}


def test_a_window_with_the_exact_mix_has_zero_tv():
    assert windowed_tv([[0, 1], [1, 0]], HALVES, window=2) == [0.0]


def test_a_window_of_one_bucket_is_off_by_the_other_buckets_share():
    assert windowed_tv([[0, 0], [0, 0]], HALVES, window=2) == [pytest.approx(0.5)]


def test_windows_are_consecutive_and_a_partial_tail_is_left_out():
    steps = [[0, 0], [0, 0], [0, 1], [1, 0], [1, 1]]
    assert windowed_tv(steps, HALVES, window=2) == [pytest.approx(0.5), 0.0]


def test_tv_compares_shares_not_counts():
    # 3:1 drawn against a 3:1 mix given unnormalised.
    assert windowed_tv([[0, 0, 0, 1]], {0: 3.0, 1: 1.0}, window=1) == [0.0]


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        windowed_tv([[0]], HALVES, window=0)


def test_producer_rates_follow_the_shares_with_one_bucket_sped_up():
    rates = producer_rates({0: 0.6, 1: 0.3, 2: 0.1}, fast_bucket=2, speedup=4.0, total_rate=130.0)
    assert sum(rates.values()) == pytest.approx(130.0)
    assert rates[0] / rates[1] == pytest.approx(2.0)  # proportional to the shares
    assert (rates[2] / 0.1) / (rates[0] / 0.6) == pytest.approx(4.0)  # 4x faster than its share
