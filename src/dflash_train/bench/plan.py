"""`dflash-train bench plan --data PREPARED_DIR`: a prepared dataset as train plans and queues it.

The production pieces on the data's own lengths and anchor counts: train's batching and bucket
choice (`--num-buckets auto` unless given), the interleaved epoch plans, the prefetchers, job
queue, target workers, hidden-state queue (depth, readiness gate, stratified pull, age bound)
and the drafters' lockstep; only the compute is simulated (`bench.sim`: a target's cost grows
with padded tokens, a drafter's with block positions). Measured:

- padding: padded tokens / all tokens of the planned batches (what the bucket count costs);
- the length mix: total-variation distance of each window of `MIX_WINDOW_STEPS` steps' batches
  from the plan's bucket shares (queue/mix_tv in a run logging every 50 steps);
- age: how many steps each batch waited in the hidden-state queue (queue/age_steps_*);
- with --max-steps: the sequences trained per epoch when the run stops there (a queue that lets
  batches wait for epochs leaves old epochs short while newer ones train).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from dflash_train.bench.common import BenchReport, add_json_argument, emit
from dflash_train.bench.mix import windowed_tv
from dflash_train.bench.sim import (
    Cost,
    SimulatedBuilder,
    SimulatedExtractor,
    SimulatedReplica,
    SleepClock,
    StepLog,
)
from dflash_train.config import PipelineOptions
from dflash_train.data.buckets import (
    Batching,
    assign_buckets,
    bucket_weights,
    fit_bucket_lengths,
    padding_fraction,
)
from dflash_train.data.dataset import PreparedDataset
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.mixing import MIX_WINDOW_STEPS
from dflash_train.pipeline.prefetch import EpochPlans
from dflash_train.pipeline.workers import PipelineError
from dflash_train.train.setup import auto_bucket_lengths

BLOCK_SIZE = 16
COLUMNS = [
    "padding", "windows", "mix_tv_mean", "mix_tv_max", "age_steps_mean", "age_steps_max",
    "age_epochs_max", "trained_per_epoch",
]  # fmt: skip


def plan_for(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, EpochPlans]:
    """Lengths, anchors per row and the epoch plans train would make for these settings."""
    ds = PreparedDataset(args.data)
    rows = slice(0, args.rows or None)  # the first --rows rows, as a small dataset would be
    lengths = np.asarray(ds.lengths, dtype=np.int64)[rows]
    anchors = np.minimum(ds.anchor_counts(), args.num_anchors)[rows]
    rule = Batching(args.batch_size, None, "work", anchors, BLOCK_SIZE, args.num_anchors, 0.0)
    draws = args.drafters * MIX_WINDOW_STEPS
    buckets = (
        fit_bucket_lengths(lengths, args.num_buckets)
        if args.num_buckets
        else auto_bucket_lengths(lengths, rule, args.seed, draws)
    )
    return lengths, anchors, EpochPlans(lengths, buckets, rule, args.seed, args.epochs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths, anchors, plans = plan_for(args)
    buckets = plans.bucket_lengths
    builder = SimulatedBuilder(lengths, buckets, anchors, BLOCK_SIZE, args.num_anchors)
    epoch = plans.epoch(0)
    weights = bucket_weights(epoch)
    tokens = np.mean([len(s.seq_ids) * buckets[s.bucket] for s in epoch])
    blocks = np.mean([builder.build(s).block_ids.numel() for s in epoch])
    clock = SleepClock.calibrate()
    targets = [
        SimulatedExtractor(clock, Cost(args.target_ms / 1000, 0.3, i, tokens))
        for i in range(args.targets)
    ]
    drafters = [
        SimulatedReplica(clock, Cost(args.drafter_ms / 1000, 0.3, 100 + i, blocks), unit="blocks")
        for i in range(args.drafters)
    ]
    total = math.ceil(len(epoch) * args.epochs / args.drafters)
    steps = StepLog()
    settings = PipelineSettings(
        total_steps=min(total, args.max_steps or total),
        hs_queue_depth=args.hs_queue_depth,
        hs_min_ready=args.hs_min_ready,
        bucket_weights=weights,
        stall_timeout_s=120.0,
        seed=args.seed,
    )
    pipeline = Pipeline(settings, TargetFeed(plans, builder, targets), drafters, listener=steps)
    t0 = time.perf_counter()
    pipeline.start()
    problems = []
    try:
        pipeline.wait(3600.0)
    except PipelineError as e:
        problems.append(str(e).splitlines()[0])
    pipeline.shutdown(timeout_s=30.0)
    ages = np.asarray(pipeline.hs_queue.take_ages() or [0]) / args.drafters  # in steps
    tvs = windowed_tv(steps.buckets, weights, MIX_WINDOW_STEPS)
    rows = np.asarray(buckets)[assign_buckets(lengths, buckets)]
    return {
        "buckets": len(buckets),
        "bucket_lengths": buckets,
        "padding": padding_fraction(lengths, rows),
        "batches_per_epoch": len(epoch),
        "steps": len(steps.batches),
        "windows": len(tvs),
        "mix_tv_mean": float(np.mean(tvs)) if tvs else float("nan"),
        "mix_tv_max": float(np.max(tvs)) if tvs else float("nan"),
        "age_steps_mean": float(ages.mean()),
        "age_steps_max": float(ages.max()),
        "age_epochs_max": float(ages.max() * args.drafters / len(epoch)),
        "trained_per_epoch": [e["trained"] for e in pipeline.accounting.per_epoch()],
        "wall_s": time.perf_counter() - t0,
        "problems": problems + pipeline.accounting.problems(complete=not args.max_steps),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PipelineOptions()
    parser.add_argument("--data", required=True, metavar="PREPARED_DIR", help="prepared dataset")
    parser.add_argument("--rows", type=int, default=0, help="only the first ROWS rows")
    parser.add_argument("--drafters", type=int, default=1, help="drafters in lockstep (1)")
    parser.add_argument("--targets", type=int, default=1, help="target workers (1)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs planned (1)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="as in train")
    parser.add_argument("--num-anchors", type=int, default=512, help="as in train (512)")
    parser.add_argument("--num-buckets", type=int, default=None, help="as in train (auto)")
    parser.add_argument("--hs-queue-depth", type=int, default=d.hs_queue_depth, help="(90)")
    parser.add_argument("--hs-min-ready", type=int, default=d.hs_min_ready, help="(30)")
    parser.add_argument("--target-ms", type=float, default=2.0, help="simulated ms per batch")
    parser.add_argument("--drafter-ms", type=float, default=4.0, help="simulated ms per batch")
    parser.add_argument("--seed", type=int, default=0, help="plan seed (0)")
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    for name in ("drafters", "targets", "epochs", "batch_size", "num_anchors"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    result = run(args)
    report = BenchReport(
        title=(
            f"bench plan: {args.data} as train plans it ({result['buckets']} buckets, "
            f"{result['batches_per_epoch']} batches/epoch), {args.targets} target(s), "
            f"{args.drafters} drafter(s), compute simulated"
        ),
        columns=COLUMNS,
        rows=[result],
        problems=result["problems"],
    )
    report.summary.update({k: v for k, v in result.items() if k != "problems"})
    report.notes.append(
        f"mix: TV per window of {MIX_WINDOW_STEPS} steps against the plan's bucket shares; age: "
        "steps a batch waited in the hidden-state queue"
    )
    return emit(report, args.json)
