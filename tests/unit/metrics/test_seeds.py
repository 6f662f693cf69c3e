"""Quality over seeds: per-variant intervals, paired differences and the evaluation's own noise,
against direct computations."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from dflash_train.metrics.intervals import t_quantile
from dflash_train.metrics.seeds import RunResult, markdown, summarize


def run(variant: str, seed: int, prompt_taus: list[float]) -> RunResult:
    return RunResult(variant, seed, statistics.fmean(prompt_taus), prompt_taus)


BASE = [run("base", s, p) for s, p in enumerate([[4, 5, 6], [5, 5, 5.5], [3, 6, 6], [4, 4, 5]])]
# "new" has seed 4 that "base" lacks, and lacks base's seed 3: 3 shared seeds (0, 1, 2).
NEW_TAUS = {0: [6, 6, 7], 1: [5, 7, 7], 2: [6, 6, 8], 4: [1, 1, 1]}
NEW = [run("new", s, p) for s, p in NEW_TAUS.items()]


def direct_eval_se(rows):
    """sqrt(MS_interaction / prompts), written out with numpy."""
    x = np.array(rows, dtype=float)
    resid = x - x.mean(1, keepdims=True) - x.mean(0, keepdims=True) + x.mean()
    n, p = x.shape
    return math.sqrt((resid**2).sum() / ((n - 1) * (p - 1)) / p)


def test_each_variant_gets_its_mean_sd_and_t_interval():
    summary = summarize(BASE + NEW, ["base", "new"])
    base = summary["variants"][0]
    taus = [r.tau for r in BASE]
    half = t_quantile(0.975, 3) * statistics.stdev(taus) / 2
    assert base["variant"] == "base" and base["n"] == 4 and base["seeds"] == [0, 1, 2, 3]
    assert base["mean"] == pytest.approx(statistics.fmean(taus))
    assert base["sd"] == pytest.approx(statistics.stdev(taus))
    assert (base["low"], base["high"]) == pytest.approx((base["mean"] - half, base["mean"] + half))
    # prompt se: the root mean square over runs of sd(prompt taus) / sqrt(prompts).
    ses = [statistics.stdev(r.prompt_taus) / math.sqrt(3) for r in BASE]
    assert base["prompt_se"] == pytest.approx(math.sqrt(sum(s * s for s in ses) / 4))
    # eval se: the two-way residuals' mean square over (4 - 1)(3 - 1), / 3 prompts.
    assert base["eval_se"] == pytest.approx(direct_eval_se([r.prompt_taus for r in BASE]))


def test_a_variant_is_compared_with_the_baseline_on_the_seeds_both_have():
    summary = summarize(BASE + NEW, ["base", "new"])
    (diff,) = summary["differences"]
    base, new = {r.seed: r for r in BASE}, {r.seed: r for r in NEW}
    d = [new[s].tau - base[s].tau for s in (0, 1, 2)]
    half = t_quantile(0.975, 2) * statistics.stdev(d) / math.sqrt(3)
    assert diff["seeds"] == [0, 1, 2] and diff["n"] == 3 and diff["baseline"] == "base"
    assert diff["mean"] == pytest.approx(statistics.fmean(d))
    assert (diff["low"], diff["high"]) == pytest.approx((diff["mean"] - half, diff["mean"] + half))
    assert diff["verdict"] == "win"  # every shared seed is ahead by 1.67-2.5
    per_seed = [
        statistics.stdev(
            [y - x for x, y in zip(base[s].prompt_taus, new[s].prompt_taus, strict=True)]
        )
        / math.sqrt(3)
        for s in (0, 1, 2)
    ]
    assert diff["prompt_se"] == pytest.approx(math.sqrt(sum(v * v for v in per_seed) / 3))
    pairs = [zip(base[s].prompt_taus, new[s].prompt_taus, strict=True) for s in (0, 1, 2)]
    d_rows = [[y - x for x, y in pair] for pair in pairs]
    assert diff["eval_se"] == pytest.approx(direct_eval_se(d_rows))


def test_the_verdict_is_a_loss_or_a_tie_by_the_interval():
    worse = [run("worse", s, [r.tau - 1.0 - 0.1 * s] * 3) for s, r in enumerate(BASE)]
    noisy = [run("noisy", s, [r.tau + (1.0 if s % 2 else -1.0)] * 3) for s, r in enumerate(BASE)]
    summary = summarize(BASE + worse + noisy, ["base", "worse", "noisy"])
    assert [d["verdict"] for d in summary["differences"]] == ["loss", "tie"]


def test_another_baseline_and_too_few_seeds():
    summary = summarize(BASE + NEW[:1], ["base", "new"], baseline="new")
    assert summary["baseline"] == "new"
    (diff,) = summary["differences"]
    assert diff["variant"] == "base" and diff["n"] == 1
    assert diff["low"] is None and diff["verdict"] is None
    new = summary["variants"][1]
    assert new["n"] == 1 and new["sd"] is None and new["mean"] == NEW[0].tau
    empty = summarize(BASE, ["base", "none"])["variants"][1]
    assert empty["n"] == 0 and empty["mean"] is None
    with pytest.raises(ValueError, match="baseline 'x'"):
        summarize(BASE, ["base"], baseline="x")


def test_the_markdown_tables_hold_every_figure():
    summary = summarize(BASE + NEW, ["base", "new"])
    text = markdown(summary, {"base": "--optimizer adamw", "new": ""})
    base = summary["variants"][0]
    (diff,) = summary["differences"]
    assert f"| base | `--optimizer adamw` | 4 | {base['mean']:.2f} | {base['sd']:.2f} |" in text
    assert f"[{base['low']:.2f}, {base['high']:.2f}]" in text
    assert f"| new | 3 | {diff['mean']:+.2f} |" in text and "| win |" in text
    assert "Against `base`" in text
    short = markdown(summarize(BASE + NEW[:1], ["base", "new"]))
    assert "| new | 1 |" in short and "fewer than 2 seeds" in short


def test_train_seconds_are_averaged_over_seeds_and_missing_when_a_run_lacks_them():
    timed = [RunResult("a", s, 3.0, [3.0, 3.0], train_s=t) for s, t in enumerate([10.0, 14.0])]
    (row,) = summarize(timed, ["a"])["variants"]
    assert row["train_s"] == pytest.approx(12.0)
    assert "| a | 2 | 3.00 |" in markdown(summarize(timed, ["a"])) and "| 12 |" in markdown(
        summarize(timed, ["a"])
    )
    (row,) = summarize([*timed, RunResult("a", 2, 3.0, [3.0, 3.0])], ["a"])["variants"]
    assert row["train_s"] is None


def test_differences_identical_at_every_seed_are_undetermined_not_a_certain_win():
    """Regression: runs the seed did not vary (every seed trains one drafter, or one run is
    recorded under several seeds) differ by the same amount at every seed; sd 0 gave an
    interval of no width off zero, and so a confident 'win' measured from nothing."""
    same = [run("same", s, [4.0, 5.0, 6.0]) for s in range(3)]
    better = [run("better", s, [5.0, 6.0, 7.5]) for s in range(3)]
    worse = [run("worse", s, [3.0, 4.0, 5.0]) for s in range(3)]
    copy = [run("copy", s, [4.0, 5.0, 6.0]) for s in range(3)]
    summary = summarize(same + better + worse + copy, ["same", "better", "worse", "copy"])
    d_better, d_worse, d_copy = summary["differences"]
    assert [d["verdict"] for d in (d_better, d_worse)] == ["undetermined", "undetermined"]
    assert d_better["mean"] == pytest.approx(7 / 6) and d_better["sd"] == 0.0
    assert d_better["identical"] is True and d_better["low"] is d_better["high"] is None
    assert d_better["half_width"] is None
    # One value of 0 at every seed: nothing told the two apart, a tie.
    assert d_copy["verdict"] == "tie" and d_copy["identical"] is True
    # A variant's own taus identical at every seed: no interval either.
    base = summary["variants"][0]
    assert base["identical"] is True and base["low"] is None and base["sd"] == 0.0
    text = markdown(summary)
    assert "| better | 3 | +1.17 | 0.00 | - (identical at every seed) | undetermined |" in text
    assert "the seed did not vary the runs" in text
    # Differences equal but for rounding (taus that vary by seed, a constant apart) too.
    shifted = [run("shifted", r.seed, [t + 0.3 for t in r.prompt_taus]) for r in BASE]
    assert len({s.tau - r.tau for s, r in zip(shifted, BASE, strict=True)}) > 1
    (diff,) = summarize(BASE + shifted, ["base", "shifted"])["differences"]
    assert diff["verdict"] == "undetermined" and diff["identical"] is True
    # Spread taus keep their interval, and no note.
    varied = summarize(BASE + NEW, ["base", "new"])
    assert varied["differences"][0]["identical"] is False
    assert "did not vary" not in markdown(varied)


def test_the_prompt_se_of_a_run_of_one_prompt_is_unknown_not_zero():
    """Regression: `compare --limit 1` reported prompt se 0.000: one prompt has no spread to
    measure, which is no spread of 0."""
    one = [run("one", s, [4.0 + s]) for s in range(3)]
    other = [run("other", s, [5.0 + 0.5 * s]) for s in range(3)]
    assert one[0].prompt_se is None
    summary = summarize(one + other, ["one", "other"])
    assert [v["prompt_se"] for v in summary["variants"]] == [None, None]
    assert summary["differences"][0]["prompt_se"] is None
    assert "| one | 3 | 5.00 | 1.00 | [2.52, 7.48] | - | - | - |" in markdown(summary)
    # A variant with one run of one prompt among runs of more: unknown too, not a mean of
    # the rest.
    mixed = summarize([*BASE, run("base", 9, [4.0])], ["base"])["variants"][0]
    assert mixed["prompt_se"] is None
