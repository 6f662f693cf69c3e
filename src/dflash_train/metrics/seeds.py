"""Quality over seeds: each variant's tau with its 95% interval, each variant against a baseline
paired seed by seed with a verdict, and the evaluation's own noise beside the seeds' spread.

Input: one `RunResult` per (variant, seed): tau (the mean over prompts of each prompt's mean
acceptance length) and the per-prompt taus it is the mean of. Output: `summarize` gives a
JSON-ready dict, `markdown` renders it as tables.

Two figures of the evaluation's own noise, beside the seeds' spread:
- `eval_se`: the noise the prompt sample adds to a run's tau beyond what every run on these
  prompts shares (`interaction_standard_error` over the runs x prompts table: a prompt hard for
  every drafter lowers every tau alike and moves no comparison). It is part of the seeds' sd;
  where it is small next to sd, the spread is the drafters' own: more seeds narrow the interval
  and more prompts would not; where it is comparable, more prompts help too. A difference's
  `eval_se` is the same figure for the prompt-by-prompt differences of its paired runs.
- `prompt_se`: sd(prompt taus) / sqrt(prompts) of one run (root mean square over runs): how far
  the tau level itself could sit on another draw of as many prompts. Every run on the same
  prompts shares most of it, so it says how well the absolute tau is known, not a comparison.
  None for a run of one prompt (`compare --limit 1`): the spread of one value is unknown.

Taus (or differences) identical at every seed have sd 0 and no interval (`identical`: the
interval fields are None): the seed did not vary the runs, or the measure is too coarse to show
their spread; a difference identical and nonzero at every seed is `undetermined`, not a win or a
loss (`dflash_train.metrics.intervals`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_train.metrics.intervals import (
    CONFIDENCE,
    Interval,
    interaction_standard_error,
    mean_interval,
    mean_sd,
    standard_error,
    verdict,
)


@dataclass(frozen=True)
class RunResult:
    """One trained and evaluated drafter."""

    variant: str
    seed: int
    tau: float
    prompt_taus: list[float]
    """tau of each evaluated prompt, in the prompts file's order (tau is their mean)."""
    train_s: float | None = None
    """Seconds its training took (with those of the runs it was trained on from, if any)."""

    @property
    def prompt_se(self) -> float | None:
        """The standard error of tau across prompts: sd of the prompt taus / sqrt(prompts);
        None for one prompt."""
        return standard_error(self.prompt_taus)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RunResult:
        """From a results.jsonl line of `dflash-train compare`; a tau that is not a finite
        number (a hand-edited or foreign record) is refused: its interval would compare as a
        tie."""
        run = cls(
            str(record["variant"]),
            int(record["seed"]),
            float(record["tau"]),
            [float(t) for t in record["prompt_taus"]],
            record.get("train_wall_s"),
        )
        if not all(math.isfinite(t) for t in (run.tau, *run.prompt_taus)):
            raise ValueError(
                f"the record of variant {run.variant!r} seed {run.seed} holds a tau that is not "
                "a finite number; remove it from results.jsonl (its run then runs again)"
            )
        return run


def _rms(values: Sequence[float | None]) -> float | None:
    """The root mean square; None when a value is unknown (a run of one prompt) or there are
    none."""
    if not values or any(v is None for v in values):
        return None
    return math.sqrt(math.fsum(v * v for v in values) / len(values))


def _interval(values: Sequence[float], confidence: float) -> tuple[dict[str, Any], Interval | None]:
    """n, mean, sd and the interval of `values` as fields (sd and interval None below 2
    values; the interval None when they are `identical`), and the interval."""
    if len(values) < 2:
        mean = mean_sd(values)[0] if values else None
        none = dict(sd=None, low=None, high=None, half_width=None, identical=None)
        return dict(n=len(values), mean=mean, **none), None
    interval = mean_interval(values, confidence)
    return _fields(interval), interval


def _fields(interval: Interval) -> dict[str, Any]:
    """The interval's fields; one of no width (`identical` values) is no interval: None."""
    out = interval.to_dict()
    out.pop("confidence")
    if interval.identical:
        out.update(sd=0.0, low=None, high=None, half_width=None)
    return out


def _eval_se(rows: Sequence[Sequence[float]]) -> float | None:
    """`interaction_standard_error` of per-prompt rows; None below 2 rows, or when the rows
    do not cover the same number of prompts."""
    if len(rows) < 2 or len({len(r) for r in rows}) != 1 or len(rows[0]) < 2:
        return None
    return interaction_standard_error(rows)


def variant_summary(
    name: str, runs: Sequence[RunResult], confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """One variant's tau over its seeds: n, mean, sd, interval, the noise figures, the values."""
    runs = sorted(runs, key=lambda r: r.seed)
    return {
        "variant": name,
        "seeds": [r.seed for r in runs],
        **_interval([r.tau for r in runs], confidence)[0],
        "eval_se": _eval_se([r.prompt_taus for r in runs]),
        "prompt_se": _rms([r.prompt_se for r in runs]),
        "train_s": _mean_or_none([r.train_s for r in runs]),
        "taus": [r.tau for r in runs],
    }


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean, None when a value is missing (or there are none)."""
    if not values or any(v is None for v in values):
        return None
    return math.fsum(values) / len(values)


def difference_summary(
    name: str,
    runs: Sequence[RunResult],
    baseline: str,
    base_runs: Sequence[RunResult],
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """`name` - `baseline` paired on the seeds both have, with the verdict (win / loss / tie,
    undetermined when identical and nonzero at every seed, None below 2 shared seeds) and the
    noise figures of the prompt-by-prompt differences."""
    mine = {r.seed: r for r in runs}
    base = {r.seed: r for r in base_runs}
    seeds = sorted(set(mine) & set(base))
    out: dict[str, Any] = {"variant": name, "baseline": baseline, "seeds": seeds}
    fields, interval = _interval([mine[s].tau - base[s].tau for s in seeds], confidence)
    out.update(fields, verdict=None if interval is None else verdict(interval))
    pairs = [(base[s].prompt_taus, mine[s].prompt_taus) for s in seeds]
    if any(len(a) != len(b) for a, b in pairs):
        out.update(eval_se=None, prompt_se=None)
        return out
    diffs = [[y - x for x, y in zip(a, b, strict=True)] for a, b in pairs]
    out["eval_se"] = _eval_se(diffs)
    out["prompt_se"] = _rms([standard_error(d) for d in diffs])
    return out


def summarize(
    results: Sequence[RunResult],
    variants: Sequence[str],
    baseline: str | None = None,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """Every variant of `variants` (in that order) over its seeds, and every other variant against
    `baseline` (default: the first)."""
    if not variants:
        raise ValueError("no variants to summarise")
    baseline = variants[0] if baseline is None else baseline
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(variants)}")
    by_variant: dict[str, list[RunResult]] = {name: [] for name in variants}
    for r in results:
        if r.variant in by_variant:
            by_variant[r.variant].append(r)
    return {
        "confidence": confidence,
        "baseline": baseline,
        "variants": [variant_summary(n, by_variant[n], confidence) for n in variants],
        "differences": [
            difference_summary(n, by_variant[n], baseline, by_variant[baseline], confidence)
            for n in variants
            if n != baseline
        ],
    }


# ============================================================================ tables


def _num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _range(row: Mapping[str, Any], spec: str = ".2f") -> str:
    if row.get("identical"):
        return "- (identical at every seed)"
    if row["low"] is None:
        return "- (fewer than 2 seeds)"
    return f"[{format(row['low'], spec)}, {format(row['high'], spec)}]"


def markdown(summary: Mapping[str, Any], flags: Mapping[str, str] | None = None) -> str:
    """The summary as two markdown tables (tau per variant; differences against the baseline)
    and a legend. `flags`: each variant's train flags, shown in a column when given."""
    pct = f"{summary['confidence']:.0%}"
    flag_col = flags is not None
    head = "| variant |" + (" flags |" if flag_col else "") + " seeds | tau mean | sd |"
    lines = [
        head + f" {pct} interval | eval se | prompt se | train s |",
        "|---" * (8 + flag_col) + "|",
    ]
    for row in summary["variants"]:
        cells = [row["variant"]] + ([f"`{flags.get(row['variant'], '')}`"] if flag_col else [])
        cells += [str(row["n"]), _num(row["mean"]), _num(row["sd"]), _range(row)]
        cells += [_num(row["eval_se"], ".3f"), _num(row["prompt_se"], ".3f")]
        cells += [_num(row.get("train_s"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    if summary["differences"]:
        lines += ["", f"Against `{summary['baseline']}`, paired on the seeds both have:", ""]
        lines += [
            f"| variant | seeds | difference | sd | {pct} interval | verdict | eval se |",
            "|---" * 7 + "|",
        ]
        for row in summary["differences"]:
            cells = [row["variant"], str(row["n"]), _num(row["mean"], "+.2f"), _num(row["sd"])]
            cells += [_range(row, "+.2f"), row["verdict"] or "-", _num(row["eval_se"], ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
    if any(row.get("identical") for row in (*summary["variants"], *summary["differences"])):
        lines += ["", IDENTICAL_NOTE]
    lines += ["", LEGEND]
    return "\n".join(lines)


IDENTICAL_NOTE = (
    "Identical at every seed: sd 0, so no interval, and a difference of one nonzero value at "
    "every seed is undetermined, not a win or a loss: the seed did not vary the runs (it reaches "
    "neither the data order nor the initialisation, or one run is recorded under several seeds), "
    "or the evaluation is too coarse to show their spread (more prompts, longer answers)."
)


LEGEND = (
    "Interval: Student t over seeds. Verdict: win / loss when the difference's interval "
    "excludes zero, tie when it holds it, undetermined when the difference is one nonzero value "
    "at every seed (sd 0). eval se: the evaluation's noise inside the seeds' sd "
    "(the run x prompt interaction's standard error in one run's tau); small next to sd, the "
    "spread is the drafters' own: more seeds narrow the interval, more prompts would not. "
    "prompt se: sd of a run's per-prompt taus / sqrt(prompts): how far the tau level could sit "
    "on other prompts, shared by every run on these prompts (- with one prompt). train s: mean "
    "seconds of training per seed, a stage's with the runs it trained on from (wall clock: on a "
    "shared machine, a rough figure)."
)
