"""Confidence intervals for quality measured at several seeds (`dflash-train compare`).

A variant trained at n seeds gives n values of tau; their mean has a 95% interval
mean +- t(0.975, n - 1) * sd / sqrt(n) (Student t, sd the sample standard deviation with
n - 1 in the denominator). Two variants trained on the same seeds are compared by the paired
difference (seed by seed), whose interval says whether the difference is distinguishable from
zero: a win (the interval is above zero), a loss (below) or a tie (it holds zero).

Values identical at every seed (`Interval.identical`: sd 0, to rounding) give an interval of no
width, which measures nothing: the seed did not vary the runs (it reaches neither the data order
nor the initialisation, or one run is recorded under several seeds), or the measure is too coarse
to show their spread. A difference of one nonzero value at every seed is then `undetermined`, not
a win or a loss; one of 0 at every seed stays a tie (nothing told the two apart).
A standard error needs 2 values: of one it is None (the spread is unknown, not 0).

The Student t quantile is computed here (no scipy): the t distribution's CDF through the
regularized incomplete beta function (its continued fraction, evaluated by the modified Lentz
method), inverted by bisection. Accurate to ~1e-10 for any df >= 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95
UNDETERMINED = "undetermined"
VERDICTS = ("win", "loss", "tie", UNDETERMINED)
IDENTICAL_TOLERANCE = 1e-12
"""sd at most this times max(1, |mean|): values identical but for rounding."""

# ============================================================================ Student t


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function I_x(a, b) (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        # Two steps per m: the even term d_{2m}, then the odd term d_{2m+1}.
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise AssertionError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # The fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t such that P(T <= t) = p, for 0 < p < 1 and df > 0 (bisection on `t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ============================================================================ summaries


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of `values`: sd / sqrt(n); None for one value (its spread
    is unknown, not 0)."""
    if len(values) == 1:
        return None
    return mean_sd(values)[1] / math.sqrt(len(values))


@dataclass(frozen=True)
class Interval:
    """A mean over n values with its two-sided interval at `confidence`."""

    n: int
    mean: float
    sd: float
    """Sample standard deviation of the values (n - 1 in the denominator)."""
    low: float
    high: float
    confidence: float = CONFIDENCE

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    @property
    def identical(self) -> bool:
        """Every value the same (sd 0, to rounding): the interval has no width and measures
        nothing (most likely the seed did not vary the runs)."""
        return self.sd <= IDENTICAL_TOLERANCE * max(1.0, abs(self.mean))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "half_width": self.half_width, "identical": self.identical}


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of `values` with its Student t interval; needs at least 2 values."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 values, got {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean, sd = mean_sd(values)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(n, mean, sd, mean - half, mean + half, confidence)


def verdict(interval: Interval) -> str:
    """'win' when the interval of a difference lies above zero, 'loss' below, else 'tie';
    'undetermined' when the difference is one nonzero value at every seed (`identical`: its
    interval of no width lies off zero, yet says nothing of how the seeds spread)."""
    if interval.identical and interval.mean != 0:
        return UNDETERMINED
    if interval.low > 0:
        return "win"
    if interval.high < 0:
        return "loss"
    return "tie"


def interaction_standard_error(rows: Sequence[Sequence[float]]) -> float:
    """The noise that the sample of columns adds to each row's mean, beyond what every row
    shares: sqrt(MS / columns), MS = the sum of the squared two-way residuals
    x[r][c] - mean(row r) - mean(column c) + mean(all), divided by (rows - 1) (columns - 1).

    For runs (rows) evaluated on the same prompts (columns): a prompt that is hard for every
    run moves every run's tau alike and no comparison between them; what does differ between
    the runs' means is the run x prompt interaction, and this is its standard error in one
    run's mean (a two-way analysis of variance without replication).
    """
    n, p = len(rows), len(rows[0]) if rows else 0
    if n < 2 or p < 2 or any(len(r) != p for r in rows):
        raise ValueError(f"need >= 2 rows of one length >= 2, got {[len(r) for r in rows]}")
    row_means = [math.fsum(r) / p for r in rows]
    col_means = [math.fsum(r[c] for r in rows) / n for c in range(p)]
    grand = math.fsum(row_means) / n
    ss = math.fsum(
        (r[c] - row_means[i] - col_means[c] + grand) ** 2
        for i, r in enumerate(rows)
        for c in range(p)
    )
    return math.sqrt(ss / ((n - 1) * (p - 1)) / p)
