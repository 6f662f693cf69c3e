"""Student t quantiles against published values, and the intervals against direct computation."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from dflash_train.metrics.intervals import (
    interaction_standard_error,
    mean_interval,
    mean_sd,
    regularized_incomplete_beta,
    standard_error,
    t_cdf,
    t_quantile,
    verdict,
)

# t(0.975, df) and t(0.95, df), to 9 significant digits (standard tables; e.g. NIST/SEMATECH).
T975 = {
    1: 12.7062047,
    2: 4.30265273,
    3: 3.18244631,
    4: 2.77644511,
    5: 2.57058184,
    9: 2.26215716,
    10: 2.22813885,
    20: 2.08596345,
    30: 2.04227246,
    100: 1.98397152,
}
T95 = {1: 6.31375151, 4: 2.13184679, 10: 1.81246112, 30: 1.69726089}
NORMAL_975 = 1.959963985


@pytest.mark.parametrize(("df", "expected"), sorted(T975.items()))
def test_the_two_sided_95_percent_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, rel=1e-8)


@pytest.mark.parametrize(("df", "expected"), sorted(T95.items()))
def test_the_one_sided_95_percent_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.95, df) == pytest.approx(expected, rel=1e-8)


def test_closed_forms_for_one_and_two_degrees_of_freedom():
    for p in (0.6, 0.9, 0.975, 0.999):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
        # df = 2: t = (2p - 1) * sqrt(2 / (4 p (1 - p))).
        assert t_quantile(p, 2) == pytest.approx(
            (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p))), rel=1e-9
        )


def test_many_degrees_of_freedom_approach_the_normal_quantile():
    assert t_quantile(0.975, 10**7) == pytest.approx(NORMAL_975, abs=1e-6)


def test_the_cdf_and_the_quantile_are_inverse_and_symmetric():
    for df in (1, 3, 7.5, 50):
        for p in (0.01, 0.3, 0.5, 0.8, 0.995):
            t = t_quantile(p, df)
            assert t_cdf(t, df) == pytest.approx(p, abs=1e-10)
            assert t_quantile(1 - p, df) == pytest.approx(-t, abs=1e-9)


def test_incomplete_beta_against_its_closed_forms():
    for x in (0.0, 0.1, 0.5, 0.93, 1.0):
        assert regularized_incomplete_beta(1, 1, x) == pytest.approx(x)  # uniform
        assert regularized_incomplete_beta(2, 1, x) == pytest.approx(x**2)
        assert regularized_incomplete_beta(1, 3, x) == pytest.approx(1 - (1 - x) ** 3)
        arcsine = 2 / math.pi * math.asin(math.sqrt(x))
        assert regularized_incomplete_beta(0.5, 0.5, x) == pytest.approx(arcsine, abs=1e-12)


def test_mean_and_sd_equal_the_statistics_module():
    rng = random.Random(0)
    values = [rng.gauss(5, 1) for _ in range(7)]
    mean, sd = mean_sd(values)
    assert mean == pytest.approx(statistics.fmean(values), rel=1e-14)
    assert sd == pytest.approx(statistics.stdev(values), rel=1e-14)
    assert standard_error(values) == pytest.approx(statistics.stdev(values) / math.sqrt(7))
    assert mean_sd([3.0]) == (3.0, 0.0)


def test_the_interval_is_the_mean_plus_minus_t_times_the_standard_error():
    values = [4.56, 5.72, 5.99, 5.10, 5.31]
    iv = mean_interval(values)
    half = 2.77644511 * statistics.stdev(values) / math.sqrt(5)
    assert iv.n == 5 and iv.mean == pytest.approx(statistics.fmean(values))
    assert iv.low == pytest.approx(iv.mean - half, rel=1e-8)
    assert iv.high == pytest.approx(iv.mean + half, rel=1e-8)
    assert iv.half_width == pytest.approx(half, rel=1e-8)
    # A 99% interval is wider.
    assert mean_interval(values, 0.99).half_width > half


def test_the_verdict_says_whether_the_interval_excludes_zero():
    assert verdict(mean_interval([0.5, 0.6, 0.7])) == "win"
    assert verdict(mean_interval([-0.5, -0.6, -0.7])) == "loss"
    assert verdict(mean_interval([0.5, -0.4, 0.2])) == "tie"


def test_the_interval_covers_the_true_mean_at_its_confidence():
    """2,000 samples of 5 normal values: the 95% interval holds the true mean about 95% of the
    time (binomial sd 0.5%); a normal quantile in place of t's would give about 88%."""
    rng = random.Random(1)
    hits = 0
    for _ in range(2000):
        iv = mean_interval([rng.gauss(3.0, 0.5) for _ in range(5)])
        hits += iv.low <= 3.0 <= iv.high
    assert 0.93 <= hits / 2000 <= 0.97


def test_fewer_than_two_values_have_no_interval():
    with pytest.raises(ValueError, match="at least 2"):
        mean_interval([1.0])
    with pytest.raises(ValueError, match="p must be"):
        t_quantile(1.0, 3)


def test_what_every_row_shares_is_no_interaction_noise():
    """Rows = runs, columns = prompts: a prompt's difficulty (a column effect) and a run's
    quality (a row effect) add nothing; only the run x prompt interaction counts."""
    difficulty = [1.0, 9.0, 4.0, 15.0, 2.5]
    rows = [[d + q for d in difficulty] for q in (0.0, 0.4, -0.3)]
    assert interaction_standard_error(rows) == pytest.approx(0.0, abs=1e-12)
    # One cell moved by h: the residuals are h times a fixed pattern whose squares sum to
    # (n - 1)(p - 1) / (n p), so MS = h^2 / (n p) and the figure is h / (p sqrt(n)).
    rows[1][2] += 0.6
    assert interaction_standard_error(rows) == pytest.approx(0.6 / (5 * math.sqrt(3)))


def test_the_interaction_noise_is_the_spread_of_run_means_it_causes():
    """Runs that differ only by independent per-prompt noise (sd 1): the spread of their
    means over 50 prompts is 1 / sqrt(50), and so is the figure, whatever the prompts' own
    spread (sd 4 here)."""
    rng = random.Random(2)
    difficulty = [rng.gauss(6, 4) for _ in range(50)]
    rows = [[d + rng.gauss(0, 1) for d in difficulty] for _ in range(40)]
    assert interaction_standard_error(rows) == pytest.approx(1 / math.sqrt(50), rel=0.05)
    means = [statistics.fmean(r) for r in rows]
    assert statistics.stdev(means) == pytest.approx(1 / math.sqrt(50), rel=0.3)
    with pytest.raises(ValueError, match="need >= 2 rows"):
        interaction_standard_error([[1.0, 2.0]])


def test_values_identical_at_every_seed_give_no_verdict_but_a_tie_at_zero():
    """Regression: sd 0 gave an interval of no width, so one nonzero difference repeated at
    every seed (runs the seed did not vary) was a certain win or loss."""
    assert verdict(mean_interval([0.3, 0.3, 0.3])) == "undetermined"
    assert verdict(mean_interval([-1.0, -1.0])) == "undetermined"
    assert verdict(mean_interval([0.0, 0.0, 0.0])) == "tie"
    # Equal but for rounding: 0.1 + 0.2 - 0.2 is not 0.1 in floating point.
    rounded = mean_interval([0.1, 0.1 + 0.2 - 0.2, 0.1])
    assert rounded.identical and verdict(rounded) == "undetermined"
    assert rounded.to_dict()["identical"] is True
    assert not mean_interval([0.5, 0.6, 0.7]).identical


def test_the_standard_error_of_one_value_is_unknown_not_zero():
    assert standard_error([3.0]) is None
    assert standard_error([3.0, 5.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no values"):
        standard_error([])
