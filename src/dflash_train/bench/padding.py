"""`dflash-train bench padding`: padded tokens with fitted length buckets vs FIFO batches.

Same rows, same batch size, two ways of batching:
- buckets (this project): bucket lengths fitted to the length histogram (`fit_bucket_lengths`),
  the epoch plan (`plan_epoch`) groups rows of one bucket, every row padded to its bucket length;
- FIFO (what most trainers do): rows in shuffled order, cut into consecutive batches, each padded
  to its own longest row.

Padding fraction = padded tokens / all tokens in the target's batches. With buckets it does not
depend on the batch size (a row's padding is its bucket length minus its length); FIFO's grows
with it. A sweep over the number of buckets shows what each extra compiled shape buys; the floor
is rounding every row to the buckets' multiple of 8.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from dflash_train.bench.common import (
    BenchReport,
    add_json_argument,
    add_seed_argument,
    emit,
    synthetic_lengths,
)
from dflash_train.config import PipelineOptions
from dflash_train.data.buckets import (
    Batching,
    assign_buckets,
    fit_bucket_lengths,
    padding_fraction,
    plan_epoch,
)
from dflash_train.data.dataset import PreparedDataset

SWEEP = (1, 2, 4, 8, 16, 32)
HEADLINE_BUCKETS = 16  # the README's padding table (train's fixed default before auto)
BUCKET_MULTIPLE = 8  # fit_bucket_lengths' default rounding of bucket lengths


def bucketed_padding(
    lengths: np.ndarray, bucket_lengths: list[int], batch_size: int, seed: int
) -> tuple[float, list[str]]:
    """Padding fraction of one epoch planned with these buckets, and any row the plan lost or
    repeated (an invariant of `plan_epoch`: every row exactly once)."""
    buckets = assign_buckets(lengths, bucket_lengths)
    plan = plan_epoch(buckets, bucket_lengths, Batching(batch_size), seed, 0)
    ids = np.fromiter((i for spec in plan for i in spec.seq_ids), dtype=np.int64)
    padded = np.fromiter(
        (bucket_lengths[spec.bucket] for spec in plan for _ in spec.seq_ids), dtype=np.int64
    )
    problems = []
    counts = np.bincount(ids, minlength=len(lengths))
    if (counts != 1).any():
        problems.append(
            f"epoch plan: {int((counts == 0).sum())} rows missing, "
            f"{int((counts > 1).sum())} rows repeated"
        )
    if (padded < lengths[ids]).any():
        problems.append("epoch plan: a row is longer than its bucket")
    return padding_fraction(lengths[ids], padded), problems


def fifo_padding(lengths: np.ndarray, batch_size: int, seed: int) -> tuple[float, int]:
    """Padding fraction of shuffled consecutive batches padded to their longest row, and the
    number of distinct padded lengths (shapes) those batches have."""
    order = np.random.default_rng([seed, 0xF1F0]).permutation(len(lengths))
    return padding_in_order(np.asarray(lengths)[order], batch_size)


def padding_in_order(lengths: np.ndarray, batch_size: int) -> tuple[float, int]:
    """Rows in the given order cut into batches of `batch_size` (the last may be short), each
    padded to its longest row: (padding fraction, distinct padded lengths)."""
    starts = np.arange(0, len(lengths), batch_size)
    longest = np.maximum.reduceat(lengths, starts)
    rows = np.diff(np.append(starts, len(lengths)))
    padded = np.repeat(longest, rows)
    return padding_fraction(lengths, padded), len(np.unique(longest))


def rounding_floor(lengths: np.ndarray, multiple: int = BUCKET_MULTIPLE) -> float:
    """Padding if every row had its own bucket (its length rounded up to `multiple`)."""
    return padding_fraction(lengths, -(-lengths // multiple) * multiple)


def measure(
    lengths: np.ndarray, batch_size: int, num_buckets: int, seed: int, sweep: tuple[int, ...]
) -> BenchReport:
    """The whole comparison on one set of lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise ValueError("no rows to measure")
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    by_k: dict[int, float] = {}
    for k in sorted({*sweep, num_buckets}):
        buckets = fit_bucket_lengths(lengths, k)
        frac, bad = bucketed_padding(lengths, buckets, batch_size, seed)
        problems += [f"{k} buckets: {p}" for p in bad]
        by_k[k] = frac
        rows.append(
            {
                "batching": "buckets" + (" (chosen)" if k == num_buckets else ""),
                "num_buckets": k,
                "shapes": len(buckets),
                "padding_fraction": frac,
                "bucket_lengths": _short(buckets),
            }
        )
    fifo, fifo_shapes = fifo_padding(lengths, batch_size, seed)
    rows.append(
        {
            "batching": "fifo, pad to longest",
            "num_buckets": "-",
            "shapes": fifo_shapes,
            "padding_fraction": fifo,
            "bucket_lengths": "-",
        }
    )
    report = BenchReport(
        title=(
            f"bench padding: {len(lengths)} rows (lengths {int(lengths.min())}-"
            f"{int(lengths.max())}, median {int(np.median(lengths))}), batch size {batch_size}"
        ),
        columns=["batching", "num_buckets", "shapes", "padding_fraction", "bucket_lengths"],
        rows=rows,
        problems=problems,
    )
    report.summary = {
        "padding_fraction": by_k[num_buckets],
        "padding_fraction_fifo": fifo,
        "num_buckets": num_buckets,
        "batch_size": batch_size,
        "rows_measured": len(lengths),
        "rounding_floor": rounding_floor(lengths),
        "by_num_buckets": by_k,
    }
    report.notes.append(
        f"rounding_floor = padding if every row had its own bucket (rounded up to a multiple of "
        f"{BUCKET_MULTIPLE}); bucketed padding does not depend on the batch size, FIFO's does"
    )
    return report


def _short(buckets: list[int], limit: int = 8) -> str:
    if len(buckets) <= limit:
        return ",".join(map(str, buckets))
    return ",".join(map(str, buckets[:3])) + ",...," + ",".join(map(str, buckets[-3:]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PipelineOptions()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="PREPARED_DIR", help="a prepared dataset directory")
    source.add_argument(
        "--synthetic",
        metavar="ROWS",
        type=int,
        help="instead of --data: this many log-normal chat-like lengths (median 600, max 3072)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help=f"rows per batch (default: {defaults.batch_size}, as in train)",
    )
    parser.add_argument(
        "--num-buckets",
        type=int,
        default=HEADLINE_BUCKETS,
        help=f"buckets of the headline figure (default: {HEADLINE_BUCKETS}; train's auto "
        "chooses from the data and its batches per step, see --help of train)",
    )
    parser.add_argument(
        "--sweep",
        default=",".join(map(str, SWEEP)),
        help="numbers of buckets also measured (default: %(default)s)",
    )
    add_seed_argument(parser)
    add_json_argument(parser)


def load_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    if args.data:
        ds = PreparedDataset(Path(args.data))
        return np.asarray(ds.lengths, dtype=np.int64), f"prepared dataset {args.data}"
    if args.synthetic < 1:
        raise ValueError(f"--synthetic must be positive, got {args.synthetic}")
    return synthetic_lengths(args.synthetic, args.seed), f"{args.synthetic} synthetic lengths"


def main(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.num_buckets < 1:
        raise ValueError("--batch-size and --num-buckets must be positive")
    try:
        sweep = tuple(int(k) for k in args.sweep.split(",") if k.strip())
    except ValueError:
        raise ValueError(f"--sweep must be a comma list of integers, got {args.sweep!r}") from None
    if any(k < 1 for k in sweep):
        raise ValueError("--sweep: numbers of buckets must be positive")
    lengths, source = load_lengths(args)
    report = measure(lengths, args.batch_size, args.num_buckets, args.seed, sweep)
    report.summary["source"] = source
    return emit(report, args.json)
