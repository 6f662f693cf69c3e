"""Quality over seeds: each recipe's tau with its 95% interval, each recipe against a baseline
paired seed by seed with a verdict, and the evaluation's own noise beside the seeds' spread.

Input: one `RunResult` per (recipe, seed): tau (the mean over prompts of each prompt's mean
acceptance length) and the per-prompt taus it is the mean of. Output: `summarize` gives a
JSON-ready dict, `markdown` renders it as tables.

The evaluation's own noise of one run is the standard error of its tau across prompts,
sd(prompt taus) / sqrt(prompts): how much tau would move on another draw of as many prompts.
A recipe's `eval_se` is its root mean square over the recipe's runs; a difference's is the
same for the prompt-by-prompt difference of the two runs (both decoded the same prompts).
Where `eval_se` is small next to the seeds' sd, the spread is the drafters' own: more seeds
narrow the interval and more prompts would not; where it is comparable, more prompts help too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_train.metrics.intervals import (
    CONFIDENCE,
    Interval,
    mean_interval,
    mean_sd,
    standard_error,
    verdict,
)


@dataclass(frozen=True)
class RunResult:
    """One trained and evaluated drafter."""

    recipe: str
    seed: int
    tau: float
    prompt_taus: list[float]
    """tau of each evaluated prompt, in the prompts file's order (tau is their mean)."""

    @property
    def eval_se(self) -> float:
        """The evaluation's standard error: sd of the prompt taus / sqrt(prompts)."""
        return standard_error(self.prompt_taus)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RunResult:
        """From a results.jsonl line of `dflash-train compare`."""
        return cls(
            str(record["recipe"]),
            int(record["seed"]),
            float(record["tau"]),
            [float(t) for t in record["prompt_taus"]],
        )


def _rms(values: Sequence[float]) -> float | None:
    return math.sqrt(math.fsum(v * v for v in values) / len(values)) if values else None


def _interval(values: Sequence[float], confidence: float) -> tuple[dict[str, Any], Interval | None]:
    """n, mean, sd and the interval of `values` as fields (sd and interval None below 2
    values), and the interval."""
    if len(values) < 2:
        mean = mean_sd(values)[0] if values else None
        return dict(n=len(values), mean=mean, sd=None, low=None, high=None, half_width=None), None
    interval = mean_interval(values, confidence)
    return _fields(interval), interval


def _fields(interval: Interval) -> dict[str, Any]:
    out = interval.to_dict()
    out.pop("confidence")
    return out


def recipe_summary(
    name: str, runs: Sequence[RunResult], confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """One recipe's tau over its seeds: n, mean, sd, interval, eval_se and the values."""
    runs = sorted(runs, key=lambda r: r.seed)
    return {
        "recipe": name,
        "seeds": [r.seed for r in runs],
        **_interval([r.tau for r in runs], confidence)[0],
        "eval_se": _rms([r.eval_se for r in runs]),
        "taus": [r.tau for r in runs],
    }


def _paired_eval_se(a: RunResult, b: RunResult) -> float | None:
    """The standard error of the prompt-by-prompt difference b - a (None when the two runs
    did not decode the same number of prompts)."""
    if len(a.prompt_taus) != len(b.prompt_taus):
        return None
    return standard_error([y - x for x, y in zip(a.prompt_taus, b.prompt_taus, strict=True)])


def difference_summary(
    name: str,
    runs: Sequence[RunResult],
    baseline: str,
    base_runs: Sequence[RunResult],
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """`name` - `baseline` paired on the seeds both have, with the verdict (win / loss / tie,
    None below 2 shared seeds)."""
    mine = {r.seed: r for r in runs}
    base = {r.seed: r for r in base_runs}
    seeds = sorted(set(mine) & set(base))
    out: dict[str, Any] = {"recipe": name, "baseline": baseline, "seeds": seeds}
    fields, interval = _interval([mine[s].tau - base[s].tau for s in seeds], confidence)
    out.update(fields, verdict=None if interval is None else verdict(interval))
    ses = [_paired_eval_se(base[s], mine[s]) for s in seeds]
    out["eval_se"] = None if None in ses else _rms([s for s in ses if s is not None])
    return out


def summarize(
    results: Sequence[RunResult],
    recipes: Sequence[str],
    baseline: str | None = None,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """Every recipe of `recipes` (in that order) over its seeds, and every other recipe against
    `baseline` (default: the first)."""
    if not recipes:
        raise ValueError("no recipes to summarise")
    baseline = recipes[0] if baseline is None else baseline
    if baseline not in recipes:
        raise ValueError(f"baseline {baseline!r} is not one of the recipes {list(recipes)}")
    by_recipe: dict[str, list[RunResult]] = {name: [] for name in recipes}
    for r in results:
        if r.recipe in by_recipe:
            by_recipe[r.recipe].append(r)
    return {
        "confidence": confidence,
        "baseline": baseline,
        "recipes": [recipe_summary(n, by_recipe[n], confidence) for n in recipes],
        "differences": [
            difference_summary(n, by_recipe[n], baseline, by_recipe[baseline], confidence)
            for n in recipes
            if n != baseline
        ],
    }


# ============================================================================ tables


def _num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _range(row: Mapping[str, Any], spec: str = ".2f") -> str:
    if row["low"] is None:
        return "- (fewer than 2 seeds)"
    return f"[{format(row['low'], spec)}, {format(row['high'], spec)}]"


def markdown(summary: Mapping[str, Any], flags: Mapping[str, str] | None = None) -> str:
    """The summary as two markdown tables (tau per recipe; differences against the baseline)
    and a legend. `flags`: each recipe's train flags, shown in a column when given."""
    pct = f"{summary['confidence']:.0%}"
    flag_col = flags is not None
    head = "| recipe |" + (" flags |" if flag_col else "") + " seeds | tau mean | sd |"
    lines = [
        head + f" {pct} interval | eval se |",
        "|---" * (6 + flag_col) + "|",
    ]
    for row in summary["recipes"]:
        cells = [row["recipe"]] + ([f"`{flags.get(row['recipe'], '')}`"] if flag_col else [])
        cells += [str(row["n"]), _num(row["mean"]), _num(row["sd"]), _range(row)]
        lines.append("| " + " | ".join([*cells, _num(row["eval_se"], ".3f")]) + " |")
    if summary["differences"]:
        lines += ["", f"Against `{summary['baseline']}`, paired on the seeds both have:", ""]
        lines += [
            f"| recipe | seeds | difference | sd | {pct} interval | verdict | eval se |",
            "|---" * 7 + "|",
        ]
        for row in summary["differences"]:
            cells = [row["recipe"], str(row["n"]), _num(row["mean"], "+.2f"), _num(row["sd"])]
            cells += [_range(row, "+.2f"), row["verdict"] or "-", _num(row["eval_se"], ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", LEGEND]
    return "\n".join(lines)


LEGEND = (
    "Interval: Student t over seeds. Verdict: win / loss when the difference's interval "
    "excludes zero, tie when it holds it. eval se: the evaluation's own standard error (sd of "
    "the per-prompt taus / sqrt(prompts), root mean square over runs); small next to sd, the "
    "spread is the seeds': more seeds narrow the interval, more prompts would not."
)
