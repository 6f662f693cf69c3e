"""`dflash-train bench mix`: the length mix drafters draw when one bucket arrives much faster.

The failure this guards against: when long sequences reach the hidden-state queue faster than the
rest, a FIFO or uniformly random pull hands the drafters mostly long batches for a while, and the
per-step length mix no longer matches the data. The scenario:

- an epoch plan (`plan_epoch`) over chat-like lengths and `--num-buckets` fitted buckets;
- one producer thread per bucket, each holding exactly that bucket's batches of the epoch and
  producing at a rate proportional to the bucket's share, except the longest bucket, which is
  `--speedup` times faster; together `--overproduce` times faster than the drafters consume;
- `--drafters` real drafter workers (`run_drafter`, lockstep `StepRendezvous`) whose micro-step
  is a calibrated sleep, pulling from a real `BufferedHSQueue` in each pull mode.

For each mode: the total-variation distance between the buckets drawn in each window of
`--window` optimizer steps and the dataset's bucket shares, averaged over the windows.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import (
    BenchReport,
    add_json_argument,
    add_seed_argument,
    emit,
    synthetic_lengths,
)
from dflash_train.bench.sim import Cost, SimulatedReplica, SleepClock, StepLog, simulated_job
from dflash_train.config import PipelineOptions
from dflash_train.data.buckets import (
    Batching,
    BatchSpec,
    assign_buckets,
    bucket_weights,
    fit_bucket_lengths,
    plan_epoch,
)
from dflash_train.pipeline.build import DirectFeed, Pipeline, PipelineSettings
from dflash_train.pipeline.queue import MIX_MODES, total_variation
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.stages import Channels
from dflash_train.pipeline.workers import PipelineError

BATCH_SIZE = 4


def windowed_tv(
    step_buckets: list[list[int]], weights: dict[int, float], window: int
) -> list[float]:
    """TV distance to `weights` of the buckets drawn in each full window of `window` steps.

    step_buckets[i] holds the bucket of every batch trained in step i; a trailing partial window
    is left out (it would compare a handful of draws to the whole distribution).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for start in range(0, len(step_buckets) - window + 1, window):
        counts: dict[int, float] = {}
        for buckets in step_buckets[start : start + window]:
            for b in buckets:
                counts[b] = counts.get(b, 0) + 1
        out.append(total_variation(counts, weights))
    return out


def producer_rates(
    weights: dict[int, float], fast_bucket: int, speedup: float, total_rate: float
) -> dict[int, float]:
    """Items/s per bucket: proportional to each bucket's share, `fast_bucket` `speedup` times
    faster, summing to `total_rate`."""
    raw = {b: w * (speedup if b == fast_bucket else 1.0) for b, w in weights.items()}
    scale = total_rate / sum(raw.values())
    return {b: r * scale for b, r in raw.items()}


@dataclass
class Scenario:
    """The epoch and the producers' speeds, shared by every pull mode."""

    lengths: np.ndarray
    bucket_lengths: list[int]
    plan: list[BatchSpec]
    weights: dict[int, float]
    rates: dict[int, float]
    drafters: int
    step_s: float
    depth: int
    min_ready: int
    window: int
    fast_bucket: int

    @property
    def consume_rate(self) -> float:
        return self.drafters / self.step_s


@dataclass
class ModeRun:
    """One pull mode's epoch: TV per window, batches drawn per bucket, broken invariants."""

    mode: str
    bucket_cap: float
    tvs: list[float]
    drawn: dict[int, int]
    wall_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.mode + (f"+cap{self.bucket_cap:g}" if self.bucket_cap > 0 else "")

    @property
    def key(self) -> str:
        """The JSON key of this run's mean TV."""
        return f"tv_{self.mode}" + ("_capped" if self.bucket_cap > 0 else "")

    @property
    def tv_mean(self) -> float:
        return float(np.mean(self.tvs)) if self.tvs else float("nan")

    def row(self) -> dict[str, Any]:
        tvs = np.asarray(self.tvs) if self.tvs else np.full(1, np.nan)
        return {
            "mode": self.label,
            "windows": len(self.tvs),
            "tv_mean": self.tv_mean,
            "tv_p90": float(np.percentile(tvs, 90)),
            "tv_max": float(tvs.max()),
            "windows_over_0.1": int((tvs > 0.1).sum()),
            "wall_s": self.wall_s,
            "drawn": self.drawn,
            "problems": self.problems,
        }


def build_scenario(args: argparse.Namespace) -> Scenario:
    rows = args.batches * BATCH_SIZE
    lengths = synthetic_lengths(rows, args.seed)
    bucket_lengths = fit_bucket_lengths(lengths, args.num_buckets)
    buckets = assign_buckets(lengths, bucket_lengths)
    plan = plan_epoch(buckets, bucket_lengths, Batching(BATCH_SIZE), args.seed, 0)
    weights = bucket_weights(plan)
    fast = max(weights)  # the longest bucket
    step_s = args.step_ms / 1000
    rates = producer_rates(weights, fast, args.speedup, args.overproduce * args.drafters / step_s)
    return Scenario(
        lengths,
        bucket_lengths,
        plan,
        weights,
        rates,
        args.drafters,
        step_s,
        args.hs_queue_depth,
        args.hs_min_ready,
        args.window,
        fast,
    )


def run_mode(
    sc: Scenario, mode: str, clock: SleepClock, seed: int, bucket_cap: float = 0.0
) -> ModeRun:
    """One epoch through the queue in pull `mode`; the drafters' steps and their buckets.

    bucket_cap > 0 prototypes a stricter per-bucket admission than the queue's own: a producer
    waits while its bucket already holds bucket_cap x share x depth batches, so a fast bucket
    cannot crowd the others out of a full buffer. The wait polls the public `bucket_sizes()`
    every millisecond (fine for a benchmark; a queue implementation would wait on its
    condition).
    """
    by_bucket: dict[int, list[BatchSpec]] = {b: [] for b in sc.weights}
    for spec in sc.plan:
        by_bucket[spec.bucket].append(spec)
    features = torch.zeros(1)

    def producer(bucket: int) -> Callable[[Channels], None]:
        period = 1.0 / sc.rates[bucket]
        cap = max(1, math.ceil(bucket_cap * sc.weights[bucket] * sc.depth))

        def produce(ch: Channels) -> None:
            for spec in by_bucket[bucket]:
                clock.sleep(period)
                while bucket_cap > 0 and ch.hs_queue.bucket_sizes().get(bucket, 0) >= cap:
                    if ch.stop.wait(0.001):
                        return
                job = simulated_job(spec, sc.lengths, sc.bucket_lengths[bucket])
                # One epoch: a batch's index in the plan is its stream position (--mix plan).
                ch.hs_queue.put(HSBatch(job, features), bucket=bucket, seq=spec.index)

        return produce

    steps = StepLog()
    settings = PipelineSettings(
        total_steps=math.ceil(len(sc.plan) / sc.drafters),
        hs_queue_depth=sc.depth,
        hs_min_ready=sc.min_ready,
        mix=mode,  # type: ignore[arg-type]
        bucket_weights=sc.weights,
        stall_timeout_s=60.0,
        seed=seed,
    )
    feed = DirectFeed([producer(b) for b in by_bucket], len(sc.lengths), epochs=1)
    replicas = [SimulatedReplica(clock, Cost(sc.step_s)) for _ in range(sc.drafters)]
    pipeline = Pipeline(settings, feed, replicas, listener=steps)
    t0 = time.perf_counter()
    pipeline.start()
    problems = _join(pipeline, deadline_s=60 + 4 * len(sc.plan) / sc.consume_rate)
    wall = time.perf_counter() - t0
    problems += _check_exactly_once(steps.batch_keys, sc.plan)
    drawn = {b: sum(x.count(b) for x in steps.buckets) for b in sc.weights}
    run = ModeRun(mode, bucket_cap, windowed_tv(steps.buckets, sc.weights, sc.window), drawn, wall)
    run.problems = [f"{run.label}: {p}" for p in problems]
    return run


def _join(pipeline: Pipeline, deadline_s: float) -> list[str]:
    problems = []
    try:
        if not pipeline.wait(deadline_s):
            problems.append(f"still running after {deadline_s:.0f}s: {pipeline.alive()}")
    except PipelineError as e:
        problems.append(str(e).splitlines()[0])
    if left := pipeline.shutdown(timeout_s=30.0):
        problems.append(f"threads did not exit after stop: {left}")
    return problems


def _check_exactly_once(drawn: list[tuple[int, int]], plan: list[BatchSpec]) -> list[str]:
    planned = {(s.epoch, s.index) for s in plan}
    seen: set[tuple[int, int]] = set()
    dups = 0
    for key in drawn:
        dups += key in seen
        seen.add(key)
    problems = []
    if dups:
        problems.append(f"{dups} batches trained more than once")
    if missing := len(planned - seen):
        problems.append(f"{missing} batches never trained")
    if extra := len(seen - planned):
        problems.append(f"{extra} batches trained that were never planned")
    return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PipelineOptions()
    parser.add_argument("--batches", type=int, default=2400, help="batches in the epoch")
    parser.add_argument("--num-buckets", type=int, default=4, help="fitted length buckets")
    parser.add_argument("--drafters", type=int, default=6, help="drafter workers in lockstep")
    parser.add_argument(
        "--step-ms", type=float, default=20.0, help="simulated drafter micro-step (ms)"
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=4.0,
        help="how many times faster the longest bucket arrives than its share (default: 4)",
    )
    parser.add_argument(
        "--overproduce",
        type=float,
        default=1.5,
        help="total production / drafters' consumption (default: 1.5)",
    )
    parser.add_argument(
        "--window", type=int, default=10, help="optimizer steps per window (default: 10)"
    )
    parser.add_argument(
        "--hs-queue-depth", type=int, default=defaults.hs_queue_depth, help="queue depth bound"
    )
    parser.add_argument(
        "--hs-min-ready", type=int, default=defaults.hs_min_ready, help="queue readiness gate"
    )
    parser.add_argument(
        "--modes", default=",".join(reversed(MIX_MODES)), help="pull modes (default: %(default)s)"
    )
    parser.add_argument(
        "--bucket-cap",
        type=float,
        default=0.0,
        help="also run each mode with a prototype per-bucket admission cap: producers wait while "
        "their bucket holds this many times its share of the depth (default: 0, off)",
    )
    add_seed_argument(parser)
    add_json_argument(parser)


def _validate(args: argparse.Namespace) -> list[str]:
    for name in ("batches", "num_buckets", "drafters", "window", "hs_queue_depth", "hs_min_ready"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.step_ms <= 0 or args.speedup <= 0 or args.overproduce <= 0:
        raise ValueError("--step-ms, --speedup and --overproduce must be positive")
    if args.bucket_cap < 0:
        raise ValueError("--bucket-cap must be >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MIX_MODES for m in modes):
        raise ValueError(f"--modes: choose from {', '.join(MIX_MODES)}, got {args.modes!r}")
    return modes


def main(args: argparse.Namespace) -> int:
    modes = _validate(args)
    sc = build_scenario(args)
    clock = SleepClock.calibrate()
    runs = [run_mode(sc, m, clock, args.seed) for m in modes]
    if args.bucket_cap > 0:
        runs += [run_mode(sc, m, clock, args.seed, args.bucket_cap) for m in modes]
    shares = ", ".join(f"{sc.bucket_lengths[b]}: {w:.2f}" for b, w in sorted(sc.weights.items()))
    report = BenchReport(
        title=(
            f"bench mix: {len(sc.plan)} batches in {len(sc.weights)} buckets (len: share "
            f"{shares}); bucket {sc.bucket_lengths[sc.fast_bucket]} arrives {args.speedup:g}x "
            f"faster; {args.drafters} drafters in lockstep; TV over windows of {args.window} "
            f"steps"
        ),
        columns=["mode", "windows", "tv_mean", "tv_p90", "tv_max", "windows_over_0.1"],
        rows=[r.row() for r in runs],
        problems=[p for r in runs for p in r.problems],
    )
    for r in runs:
        report.summary[r.key] = r.tv_mean
    report.summary.update(
        {
            "weights": {sc.bucket_lengths[b]: w for b, w in sc.weights.items()},
            "producer_rates": {sc.bucket_lengths[b]: r for b, r in sc.rates.items()},
            "consume_rate": sc.consume_rate,
            "draws_per_window": args.window * args.drafters,
        }
    )
    report.notes.append(
        "TV = total-variation distance between the buckets drawn in a window and the dataset's "
        "shares (0 = the exact mix, 1 = disjoint); a bucket missing from a window costs its share"
    )
    return emit(report, args.json)
