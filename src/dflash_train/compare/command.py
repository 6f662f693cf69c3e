"""`dflash-train compare`: variants at N seeds, and their tau with 95% intervals.

For each seed, for each variant: `train --seed S` with the common flags and then the variant's,
`export`, and the evaluation (`eval --json`, or the reference client), each a subprocess with
its log kept (layout: `dflash_train.compare.runs`). Results are appended to results.jsonl as
each run finishes; a rerun skips what is done. Then summary.json and summary.md (printed):
per variant n, mean, sd, the 95% Student t interval and the evaluation's own standard error;
each variant against the first (the baseline), paired on the seeds both have, with a verdict
(`dflash_train.metrics.seeds`). `--report-only` recomputes the summary from results.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Never

from dflash_train.compare.reference import require_reference_client
from dflash_train.compare.runs import (
    EVAL_CLIENTS,
    Runner,
    RunPaths,
    Settings,
    StepFailed,
    Variant,
    append_result,
    check_against_record,
    check_variants,
    eval_argv,
    last_line,
    make_record,
    parse_flags,
    read_results,
    read_settings,
    run_paths,
    subprocess_runner,
    train_argv,
    trained,
    write_settings,
)
from dflash_train.config import PipelineOptions, TrainConfig, add_train_arguments, train_flags
from dflash_train.metrics.seeds import RunResult, markdown, summarize
from dflash_train.speculative import MIN_NEW_TOKENS

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
DAY_S = 86_400.0


class Comparison:
    """Runs what is missing of (variants x seeds) into `out`, one run at a time."""

    def __init__(
        self,
        out: Path,
        settings: Settings,
        variants: Sequence[Variant],
        seeds: Sequence[int],
        runner: Runner = subprocess_runner,
        step_timeout_s: float = DAY_S,
        say: Callable[[str], None] = print,
    ) -> None:
        self.out, self.settings, self.variants, self.seeds = out, settings, variants, seeds
        self.runner, self.step_timeout_s, self.say = runner, step_timeout_s, say
        self.by_name = {r.name: r for r in variants}

    def run(self) -> list[dict[str, Any]]:
        """Every (variant, seed) not yet in results.jsonl; returns all the records."""
        self.out.mkdir(parents=True, exist_ok=True)
        records = read_results(self.out)
        check_against_record(self.out, self.settings, self.variants, records)
        write_settings(self.out, self.settings, self.variants, self.seeds)
        done = {(r["variant"], r["seed"]) for r in records}
        todo = [(s, r) for s in self.seeds for r in self.variants if (r.name, s) not in done]
        total = len(self.seeds) * len(self.variants)
        self.say(f"compare: {total - len(todo)} of {total} runs done, {len(todo)} to run")
        for i, (seed, variant) in enumerate(todo, 1):
            t0 = time.monotonic()
            self.say(f"[{i}/{len(todo)}] {variant.name} seed {seed}: {variant.text or '(common)'}")
            record = self.run_one(variant, seed)
            append_result(self.out, record)
            se = record["prompt_se"]  # None with one prompt: its spread is unknown
            se_text = "-" if se is None else f"{se:.3f}"
            self.say(
                f"    tau {record['tau']:.3f} (prompt se {se_text}, "
                f"{record['num_prompts']} prompts) in {time.monotonic() - t0:.0f} s"
            )
        return read_results(self.out)

    def run_one(self, variant: Variant, seed: int) -> dict[str, Any]:
        """Train (unless this very command already finished), export, evaluate."""
        paths = run_paths(self.out, variant.name, seed)
        for need in variant.needs:
            self.ensure_trained(self.by_name[need], seed)
        train = self.train(variant, seed)
        export = ["-m", "dflash_train", "export", str(paths.run), "--out", str(paths.export)]
        self._step("export", [*export, "--target", self.settings.target], paths, variant, seed)
        paths.eval_json.unlink(missing_ok=True)
        self._step("eval", eval_argv(self.settings, paths), paths, variant, seed)
        report = json.loads(paths.eval_json.read_text())
        return make_record(variant, seed, self.settings, train, report)

    def train(self, variant: Variant, seed: int) -> dict[str, Any]:
        """The train result of (variant, seed), training it unless this very command finished."""
        paths = run_paths(self.out, variant.name, seed)
        argv = train_argv(self.out, self.settings, variant, seed)
        train = trained(paths, argv)
        if train is None:
            paths.root.mkdir(parents=True, exist_ok=True)
            paths.job.write_text(json.dumps({"train_argv": argv}, indent=2) + "\n")
            self._step("train", argv, paths, variant, seed)
            train = trained(paths, argv)
            if train is None:
                raise StepFailed(f"train of {variant.name} seed {seed} wrote no result.json", 1)
        return train

    def ensure_trained(self, variant: Variant, seed: int) -> None:
        """The run another variant's flags name (`{run:NAME}`): trained again when only its
        record is here (a record carried from elsewhere), and then its weights must be the
        recorded ones: a run is a function of its flags, seed and inputs."""
        train = self.train(variant, seed)
        for rec in read_results(self.out):
            if (rec["variant"], rec["seed"]) != (variant.name, seed):
                continue
            if rec.get("weights_digest") != train.get("weights_digest"):
                raise StepFailed(
                    f"variant {variant.name!r} seed {seed} trained again to weights "
                    f"{train.get('weights_digest')}, recorded as {rec.get('weights_digest')}: "
                    "the run did not reproduce (--batch-cost auto times the drafter on the "
                    "machine: give flops, blocks or a share; or another machine kind or torch "
                    "version); use another --out",
                    1,
                )

    def _step(
        self, step: str, argv: Sequence[str], paths: RunPaths, variant: Variant, seed: int
    ) -> None:
        log = paths.log(step)
        code = self.runner(argv, log, self.step_timeout_s)
        if code != 0:
            raise StepFailed(
                f"{step} of variant {variant.name!r} seed {seed} exited {code}: "
                f"{last_line(log)} (log: {log})",
                code,
            )


# ============================================================================ summary


def write_summary(out: Path, baseline: str | None = None) -> str:
    """summary.json and summary.md from OUT's results.jsonl and variants; returns the markdown."""
    doc = read_settings(out)
    records = read_results(out)
    if not records:
        raise ValueError(f"{out} has no finished runs yet (results.jsonl is empty or missing)")
    variants = list(doc["variants"])
    summary = summarize(with_sources_time(records, doc["variants"]), variants, baseline)
    summary["settings"] = doc["settings"]
    summary["flags"] = doc["variants"]
    (out / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary, doc["variants"])
    (out / SUMMARY_MD).write_text(text + "\n")
    return text


def with_sources_time(records: list[dict[str, Any]], flags: dict[str, str]) -> list[RunResult]:
    """The runs, a stage's train seconds with those of the runs it was trained on from (its
    `{run:NAME}`s at the same seed, and theirs): what the stage's drafter cost in all. None when
    one of them is not recorded. `flags` come from every invocation into the record, which
    `check_variants` did not see together: variants that name each other round are refused."""
    seconds = {(r["variant"], r["seed"]): r.get("train_wall_s") for r in records}
    needs = {name: Variant.parse(f"{name}={text}").needs for name, text in flags.items()}

    def total(name: str, seed: int, path: tuple[str, ...] = ()) -> float | None:
        if name in path:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise ValueError(f"the record's variants name each other round ({cycle})")
        sources = [total(n, seed, (*path, name)) for n in needs.get(name, [])]
        parts = [seconds.get((name, seed)), *sources]
        return None if any(p is None for p in parts) else math.fsum(parts)

    runs = [RunResult.from_record(r) for r in records]
    return [dataclasses.replace(r, train_s=total(r.variant, r.seed)) for r in runs]


# ============================================================================ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train compare`."""
    parser.add_argument("--out", required=True, help="directory of the runs and the summary")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a variant: a name and its train flags, shell-quoted, applied after --train-flags "
        "(e.g. 'decay=--position-weights decay --optimizer adamw'); repeat it; the first is "
        "the baseline; {run:NAME} in the flags is variant NAME's train run at the same seed "
        "(e.g. 'opd=--init-from {run:sft} --anchors on-policy')",
    )
    parser.add_argument("--target", help="target model directory (train, export and eval)")
    parser.add_argument("--data", help="prepared data directory (train --data)")
    parser.add_argument("--prompts", help="evaluation prompts, JSON lines (eval --prompts)")
    parser.add_argument(
        "--train-flags",
        default="",
        help="train flags every variant shares, shell-quoted (--seed, --out, --target, --data "
        "are set by compare)",
    )
    parser.add_argument(
        "--seeds", type=int, default=5, help="seeds per variant, >= 2 (default: %(default)s)"
    )
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from this one")
    parser.add_argument(
        "--eval",
        choices=EVAL_CLIENTS,
        default="project",
        help="project: `dflash-train eval` (tested equal to the reference client); reference: "
        "PyPI dflash's client (pip install --no-deps dflash==0.1.0) (default: %(default)s)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="per prompt (default: %(default)s)"
    )
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts")
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=DAY_S,
        help="seconds one train, export or eval may run before it is stopped "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="recompute summary.json and summary.md from OUT/results.jsonl; run nothing",
    )
    parser.add_argument(
        "--baseline", default=None, help="the variant the others are compared with (default: first)"
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The shared settings, checked before anything runs."""
    for flag in ("target", "data", "prompts"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag} is required (unless --report-only)")
    for flag in ("target", "data"):
        if not Path(getattr(args, flag)).is_dir():
            raise ValueError(f"--{flag} {getattr(args, flag)} is not a directory")
    if not Path(args.prompts).is_file():
        raise ValueError(f"--prompts {args.prompts} does not exist")
    if args.seeds < 2:
        raise ValueError(f"--seeds must be >= 2 for an interval, got {args.seeds}")
    if args.max_new_tokens < MIN_NEW_TOKENS:
        raise ValueError(
            f"--max-new-tokens must be >= {MIN_NEW_TOKENS} (the first new token comes from the "
            f"prefill; drafts are verified after it), got {args.max_new_tokens}"
        )
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.step_timeout <= 0:
        raise ValueError(f"--step-timeout must be > 0, got {args.step_timeout}")
    if args.eval == "reference":
        require_reference_client()
    return Settings(
        target=str(Path(args.target).resolve()),
        data=str(Path(args.data).resolve()),
        prompts=str(Path(args.prompts).resolve()),
        train_flags=parse_flags(args.train_flags, "--train-flags"),
        eval=args.eval,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
    )


def timed_batch_cost(flags: Sequence[str]) -> bool:
    """Whether train `flags` leave work batching's budget to a cost timed on the machine
    (the last of equal flags wins, as in argparse)."""
    last: dict[str, str] = {}
    for i, flag in enumerate(flags):
        key, eq, value = flag.partition("=")
        if key in ("--batch-cost", "--batching"):
            last[key] = value if eq else (flags[i + 1] if i + 1 < len(flags) else "")
    work = last.get("--batching", PipelineOptions().batching) == "work"
    return work and last.get("--batch-cost", PipelineOptions().batch_cost) == "auto"


class _TrainFlags(argparse.ArgumentParser):
    """`train`'s parser (and the --debug every command takes), raising instead of exiting: a
    bad flag is an error before anything runs, not after the variants before it trained."""

    def __init__(self) -> None:
        super().__init__(prog="dflash-train train", add_help=False)
        add_train_arguments(self)
        self.add_argument("--debug", action="store_true")

    def error(self, message: str) -> Never:
        raise ValueError(message)


def check_train_flags(out: Path, settings: Settings, variants: Sequence[Variant]) -> None:
    """Each variant's train command line parses and makes a valid config; one line naming the
    variant otherwise, before the first run."""
    parser = _TrainFlags()
    for variant in variants:
        argv = train_argv(out, settings, variant, 0)[3:]  # after `-m dflash_train train`
        try:
            TrainConfig.from_layers(train_flags(parser.parse_args(argv)))
        except ValueError as e:
            raise ValueError(
                f"variant {variant.name!r}: train refuses its flags: {e} (with --train-flags "
                f"{shlex.join(settings.train_flags) or '(none)'})"
            ) from e


def main(args: argparse.Namespace, runner: Runner = subprocess_runner) -> int:
    """Run what is missing (unless --report-only), then write and print the summary."""
    out = Path(args.out)
    if not args.report_only:
        variants = [Variant.parse(spec) for spec in args.variant]
        check_variants(variants)
        if args.baseline is not None and args.baseline not in {r.name for r in variants}:
            raise ValueError(f"--baseline {args.baseline!r} is not one of the --variant names")
        settings = settings_from_args(args)
        check_train_flags(out, settings, variants)
        timed = [r.name for r in variants if timed_batch_cost([*settings.train_flags, *r.flags])]
        if timed:
            print(
                f"compare: note: {', '.join(timed)} plan batches by a cost timed on this machine "
                "(--batch-cost auto): a run made again may plan others; --batch-cost flops "
                "(the default), blocks or a share makes runs reproducible",
                file=sys.stderr,
            )
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        comparison = Comparison(out, settings, variants, seeds, runner, args.step_timeout)
        try:
            comparison.run()
        except StepFailed as e:
            print(f"dflash-train compare: error: {e}", file=sys.stderr)
            return 2 if e.code == 2 else 1
    print(write_summary(out, args.baseline))
    print(f"summary written to {out / SUMMARY_JSON} and {out / SUMMARY_MD}", file=sys.stderr)
    return 0
