"""`dflash-train bench pipeline`: achieved / ideal throughput of the real pipeline machinery.

The prefetchers, job queue, target workers, hidden-state queue, drafter workers, lockstep
rendezvous and `WorkerGroup` are the production ones (`pipeline/*.py`); only the compute is a
calibrated sleep (see `bench.sim`). For each configuration (target:drafter ratio, per-batch costs,
queue settings) the run trains one epoch of about `--seconds` worth of batches and measures, in
steady state (the fill-up at the start and the drain at the end left out), the batches trained
per second against the ideal: the slower side's aggregate capacity, workers / seconds per batch.

Two ideals are reported: from the MEASURED seconds per batch of each side (the sleeps as they
actually ran on this machine; `efficiency`, what the machinery loses) and from the NOMINAL
seconds (`efficiency_nominal`, which also charges sleeps that woke late on a busy machine).
Every run also checks the exactly-once accounting: every sequence read was processed by a target
and trained exactly once, and the hidden-state queue handed out every batch it took in.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import (
    BenchReport,
    add_json_argument,
    add_seed_argument,
    emit,
    synthetic_anchors,
    synthetic_lengths,
)
from dflash_train.bench.sim import (
    Cost,
    QueueSampler,
    SimulatedBuilder,
    SimulatedExtractor,
    SimulatedReplica,
    SleepClock,
    StepLog,
    lockstep_bound,
    simulated_job,
    steady_rate,
)
from dflash_train.config import PipelineOptions, token_share_of
from dflash_train.data.buckets import Batching, BatchSpec, bucket_weights, fit_bucket_lengths
from dflash_train.objective import blocks_per_row
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.costing import CostFit, ProbeShape, measure_drafter_cost, probe_shapes
from dflash_train.pipeline.prefetch import EpochPlans
from dflash_train.pipeline.queue import MIX_MODES
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.workers import PipelineError

BATCH_SIZE = 4
NUM_BUCKETS = 8
NUM_ANCHORS = 512  # train's defaults
BLOCK_SIZE = 16
FEATURE_BYTES_PER_TOKEN = 4  # simulated hidden-state bytes per padded token (for the byte bound)


@dataclass(frozen=True)
class PipelineCase:
    """One simulated configuration.

    target_ms / drafter_ms: nominal seconds per batch of one target worker / one drafter
    micro-step, in ms. bytes_in_batches: if set, a --hs-queue-bytes bound worth this many
    average batches of simulated hidden states (exercises the byte-bound path).
    """

    key: str
    targets: int
    drafters: int
    target_ms: float
    drafter_ms: float
    depth: int = 90
    min_ready: int = 30
    bytes_in_batches: int | None = None

    @property
    def target_capacity(self) -> float:
        """Nominal batches/s of all target workers together."""
        return self.targets / (self.target_ms / 1000)

    @property
    def drafter_capacity(self) -> float:
        return self.drafters / (self.drafter_ms / 1000)

    def describe(self) -> str:
        q = f"q{self.depth}/{self.min_ready}"
        if self.bytes_in_batches:
            q += f" bytes~{self.bytes_in_batches}b"
        return f"{self.targets}:{self.drafters} {self.target_ms:g}/{self.drafter_ms:g}ms {q}"


# Ratios from the issue (1:1, 2:6, 1:7), each target-bound, drafter-bound or balanced, with the
# default queue (90 / 30), a small one, and a byte bound where it is meant to bind (drafters
# slower: the buffer fills up to the memory bound, below the depth bound).
DEFAULT_CASES = (
    PipelineCase("1:1", 1, 1, 50, 50),
    PipelineCase("2:6", 2, 6, 40, 100),
    PipelineCase("2:6-small", 2, 6, 40, 100, depth=8, min_ready=4),
    PipelineCase("1:7", 1, 7, 12, 100),
    PipelineCase("1:7-bytes", 1, 7, 12, 100, bytes_in_batches=40),
    PipelineCase("1:7-balanced", 1, 7, 100 / 7, 100, depth=16, min_ready=8),
)
# Opt-in diagnostics (`--cases 2:6-tight-bytes`): a byte bound worth only 40 average batches with
# min_ready 30 while the targets are the bottleneck. The buffered mix of buckets drifts (a random
# walk: arrivals are random, stratified draws follow the weights), so when it drifts towards long
# batches the byte bound binds below min_ready and blocks the slower side.
EXTRA_CASES = (PipelineCase("2:6-tight-bytes", 2, 6, 40, 100, bytes_in_batches=40),)


@dataclass
class CaseRun:
    """Everything measured in one configuration's run."""

    case: PipelineCase
    batches: int
    steady_rate: float
    steady_s: float
    steady_steps: int
    whole_rate: float
    target_s_per_batch: float
    drafter_s_per_batch: float
    target_busy: float
    drafter_busy: float
    producer_blocked_s: float
    consumer_starved_s: float
    consumer_hol_s: float
    mean_depth: float
    mean_bytes_used: float
    lockstep_bound: float
    samples: list[dict[str, Any]]
    problems: list[str]
    token_share: float = 0.0
    """The token share work batching planned with (measured with --batch-cost auto)."""
    versus: CaseRun | None = None
    """The same case under `--compare-mix`'s pull, on the same plan (None: not compared)."""

    @property
    def ideal(self) -> float:
        """Batches/s the slower side can do, from the seconds per batch measured in this run."""
        return min(
            self.case.targets / self.target_s_per_batch,
            self.case.drafters / self.drafter_s_per_batch,
        )

    @property
    def ideal_nominal(self) -> float:
        return min(self.case.target_capacity, self.case.drafter_capacity)

    def row(self) -> dict[str, Any]:
        c = self.case
        side = (
            "targets"
            if c.target_capacity < c.drafter_capacity * 0.98
            else "drafters"
            if c.drafter_capacity < c.target_capacity * 0.98
            else "balanced"
        )
        return {
            "case": c.key,
            "setup": c.describe(),
            "bound": side,
            "batches": self.batches,
            "achieved_bps": self.steady_rate,
            "ideal_bps": self.ideal,
            "efficiency": self.steady_rate / self.ideal,
            "ideal_nominal_bps": self.ideal_nominal,
            "efficiency_nominal": self.steady_rate / self.ideal_nominal,
            "whole_run_efficiency": self.whole_rate / self.ideal,
            "steady_s": self.steady_s,
            "steady_steps": self.steady_steps,
            "target_busy": self.target_busy,
            "drafter_busy": self.drafter_busy,
            "producer_blocked_s": self.producer_blocked_s,
            "consumer_starved_s": self.consumer_starved_s,
            "consumer_hol_s": self.consumer_hol_s,
            "mean_depth": self.mean_depth,
            "mean_bytes_used": self.mean_bytes_used,
            "lockstep_bound": self.lockstep_bound,
            "token_share": self.token_share,
            "vs_mix_bps": self.versus.steady_rate if self.versus else None,
            "rate_vs_mix": self.steady_rate / self.versus.steady_rate if self.versus else None,
            "problems": self.problems,
        }


@dataclass
class Epoch:
    """The simulated data: lengths, anchors per row, fitted buckets and the one-epoch plan."""

    lengths: np.ndarray
    anchors: np.ndarray
    bucket_lengths: list[int]
    plans: EpochPlans

    @property
    def plan(self) -> list[BatchSpec]:
        return self.plans.epoch(0)

    def builder(self) -> SimulatedBuilder:
        return SimulatedBuilder(self.lengths, self.bucket_lengths, self.anchors, BLOCK_SIZE)

    def padded_tokens(self) -> np.ndarray:
        """Padded tokens of every planned batch (what a token-scaled cost is proportional to)."""
        return np.array([len(s.seq_ids) * self.bucket_lengths[s.bucket] for s in self.plan])

    def block_positions(self) -> np.ndarray:
        """Block positions of every planned batch (the drafter's work in the work model)."""
        build = self.builder().build
        return np.array([build(s).block_ids.numel() for s in self.plan])


def make_epoch(
    num_batches: int,
    seed: int,
    batching: str = "work",
    batch_tokens: int | None = None,
    token_share: float = 0.0,
) -> Epoch:
    """About `num_batches` batches' worth of rows (BATCH_SIZE per batch of fully anchored
    rows), planned as train plans them with `batching` (and `batch_tokens`, `token_share`)."""
    lengths = synthetic_lengths(num_batches * BATCH_SIZE, seed)
    anchors = synthetic_anchors(lengths, seed, NUM_ANCHORS)
    bucket_lengths = fit_bucket_lengths(lengths, NUM_BUCKETS)
    plan_rule = Batching(
        BATCH_SIZE,
        batch_tokens,
        batching,  # type: ignore[arg-type]
        anchors if batching == "work" else None,
        BLOCK_SIZE,
        NUM_ANCHORS,
        token_share,
    )
    plans = EpochPlans(lengths, bucket_lengths, plan_rule, seed, 1)
    return Epoch(lengths, anchors, bucket_lengths, plans)


class SimulatedPipeline:
    """The production pipeline (`Pipeline`, as the trainer builds it) around simulated
    compute: build (in __init__) -> start() -> wait() -> result(); one epoch, then every thread
    ends."""

    def __init__(
        self,
        case: PipelineCase,
        epoch: Epoch,
        clock: SleepClock,
        *,
        jitter: float = 0.0,
        cost_model: str = "constant",
        mix: str = "plan",
        seed: int = 0,
    ) -> None:
        self.case, self.epoch, self.seed = case, epoch, seed
        target_unit, drafter_unit = cost_units(cost_model, epoch)
        opts = PipelineOptions()  # job queue depth and prefetchers as in a default run
        tokens = epoch.padded_tokens()
        self.max_bytes = (
            None
            if case.bytes_in_batches is None
            else int(case.bytes_in_batches * tokens.mean() * FEATURE_BYTES_PER_TOKEN)
        )
        self.steps = StepLog()
        self.extractors = [
            SimulatedExtractor(
                clock,
                Cost(case.target_ms / 1000, jitter, seed * 1000 + i, target_unit),
                feature_bytes=FEATURE_BYTES_PER_TOKEN,
            )
            for i in range(case.targets)
        ]
        self.replicas = [
            SimulatedReplica(
                clock,
                Cost(case.drafter_ms / 1000, jitter, seed * 1000 + 500 + i, drafter_unit),
                unit="blocks" if cost_model == "work" else "tokens",
            )
            for i in range(case.drafters)
        ]
        settings = PipelineSettings(
            total_steps=math.ceil(len(epoch.plan) / case.drafters),
            num_prefetchers=opts.num_prefetchers,
            job_queue_depth=opts.job_queue_depth,
            hs_queue_depth=case.depth,
            hs_min_ready=case.min_ready,
            hs_queue_bytes=self.max_bytes,
            mix=mix,  # type: ignore[arg-type]
            bucket_weights=bucket_weights(epoch.plan),
            stall_timeout_s=60.0,
            seed=seed,
        )
        feed = TargetFeed(epoch.plans, epoch.builder(), self.extractors)
        self.pipeline = Pipeline(settings, feed, self.replicas, listener=self.steps)
        self.sampler = QueueSampler(self.pipeline.hs_queue)

    def start(self) -> None:
        self.t_start = time.perf_counter()
        self.pipeline.start()
        self.sampler.start()

    def wait(self, deadline_s: float) -> list[str]:
        """Join every worker; an error or a run past the deadline is a problem (not a raise:
        the other configurations still run and the command exits non-zero at the end)."""
        problems: list[str] = []
        try:
            if not self.pipeline.wait(deadline_s):
                problems.append(f"pipeline still running after {deadline_s:.0f}s")
        except PipelineError as e:
            problems.append(str(e).splitlines()[0])
        if left := self.pipeline.shutdown(timeout_s=30.0):
            problems.append(f"threads did not exit after stop: {left}")
        self.sampler.stop()
        return problems

    def result(self, problems: list[str], drafter_cost: Cost, drafter_units: np.ndarray) -> CaseRun:
        """Steady-state rate, measured stage costs, and the exactly-once checks."""
        case, plan, steps = self.case, self.epoch.plan, self.steps
        wall = (steps.times[-1] if steps.times else time.perf_counter()) - self.t_start
        rate, span, nsteps = steady_rate(steps.times, steps.batches)
        q = self.pipeline.hs_queue.stats()
        problems = problems + self.pipeline.accounting.problems(complete=not problems)
        if not problems and not (q.put_total == q.got_total == len(plan) == sum(steps.batches)):
            problems.append(
                f"{len(plan)} batches planned, {q.put_total} put on the hidden-state queue, "
                f"{q.got_total} taken, {sum(steps.batches)} trained"
            )
        t_log = [s for ex in self.extractors for s in ex.log.seconds]
        d_log = [s for rep in self.replicas for s in rep.log.seconds]
        return CaseRun(
            case=case,
            batches=len(plan),
            steady_rate=rate,
            steady_s=span,
            steady_steps=nsteps,
            whole_rate=sum(steps.batches) / wall if wall > 0 else float("nan"),
            target_s_per_batch=sum(t_log) / max(1, len(t_log)),
            drafter_s_per_batch=sum(d_log) / max(1, len(d_log)),
            target_busy=sum(t_log) / (case.targets * wall),
            drafter_busy=sum(d_log) / (case.drafters * wall),
            producer_blocked_s=q.producer_blocked_s,
            consumer_starved_s=q.consumer_starved_s,
            consumer_hol_s=q.consumer_hol_s,
            mean_depth=self.sampler.mean("depth"),
            mean_bytes_used=(
                self.sampler.mean("bytes") / self.max_bytes if self.max_bytes else float("nan")
            ),
            lockstep_bound=lockstep_bound(drafter_cost, drafter_units, case.drafters, self.seed),
            samples=self.sampler.samples,
            problems=[f"{case.key}: {p}" for p in problems],
        )


def run_case(
    case: PipelineCase,
    seconds: float,
    clock: SleepClock,
    *,
    jitter: float = 0.0,
    cost_model: str = "constant",
    batching: str = "work",
    batch_tokens: int | None = None,
    token_share: float | None = None,
    mix: str = "plan",
    seed: int = 0,
    compare_mix: str | None = None,
) -> CaseRun:
    """One epoch of about `seconds` at the ideal rate through the real pipeline threads; with
    work batching and `token_share` None (--batch-cost auto) the plan's token share is measured
    on a simulated drafter first, as train measures it on the first replica. With
    `compare_mix`, the same plan runs again under that pull (`CaseRun.versus`)."""
    ideal_nominal = min(case.target_capacity, case.drafter_capacity)
    num_batches = max(4 * case.drafters, math.ceil(ideal_nominal * seconds))
    epoch = make_epoch(num_batches, seed, batching, batch_tokens, token_share or 0.0)
    if batching == "work" and token_share is None:
        fit = measure_simulated_cost(case, epoch, clock, cost_model, jitter, seed)
        if fit.token_share:
            epoch = make_epoch(num_batches, seed, batching, batch_tokens, fit.token_share)
    run = _run_epoch(case, epoch, seconds, clock, jitter, cost_model, mix, seed)
    if compare_mix is not None:
        run.versus = _run_epoch(case, epoch, seconds, clock, jitter, cost_model, compare_mix, seed)
        run.problems += run.versus.problems
    return run


def _run_epoch(
    case: PipelineCase,
    epoch: Epoch,
    seconds: float,
    clock: SleepClock,
    jitter: float,
    cost_model: str,
    mix: str,
    seed: int,
) -> CaseRun:
    sim = SimulatedPipeline(
        case, epoch, clock, jitter=jitter, cost_model=cost_model, mix=mix, seed=seed
    )
    sim.start()
    problems = sim.wait(deadline_s=3 * seconds + 60)
    _, per_unit = cost_units(cost_model, epoch)
    units = epoch.block_positions() if cost_model == "work" else epoch.padded_tokens()
    run = sim.result(problems, Cost(case.drafter_ms / 1000, jitter, 0, per_unit), units)
    run.token_share = epoch.plans.batching.token_share
    return run


def measure_simulated_cost(
    case: PipelineCase,
    epoch: Epoch,
    clock: SleepClock,
    cost_model: str,
    jitter: float,
    seed: int,
) -> CostFit:
    """`pipeline.costing`'s measurement on a simulated drafter of `case` (its cost model, its
    nominal seconds scaled as the run's), with probe batches around a full batch of the longest
    bucket."""
    _, per_unit = cost_units(cost_model, epoch)
    replica = SimulatedReplica(
        clock,
        Cost(case.drafter_ms / 1000, jitter, seed * 1000 + 499, per_unit),
        unit="blocks" if cost_model == "work" else "tokens",
    )

    def make_batch(shape: ProbeShape) -> HSBatch:
        spec = BatchSpec(0, -1, 0, tuple(range(shape.rows)))
        anchors = max(0, min(shape.supervised - 1, NUM_ANCHORS))
        positions = blocks_per_row(anchors, NUM_ANCHORS) * BLOCK_SIZE
        job = simulated_job(spec, np.full(shape.rows, shape.length), shape.length, positions)
        return HSBatch(job, torch.zeros(0))

    shapes = probe_shapes(epoch.bucket_lengths[-1], BATCH_SIZE)
    return measure_drafter_cost(replica, make_batch, shapes, clock=clock.now)


def cost_units(cost_model: str, epoch: Epoch) -> tuple[float | None, float | None]:
    """Mean batch size in the unit each side's cost scales with, (target, drafter):
    constant: neither scales; tokens: both with padded tokens; work (the realistic model): the
    target with padded tokens, the drafter with block positions."""
    if cost_model == "constant":
        return None, None
    tokens = float(epoch.padded_tokens().mean())
    if cost_model == "tokens":
        return tokens, tokens
    return tokens, float(epoch.block_positions().mean())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="length of each configuration's run at its ideal rate (default: 8)",
    )
    parser.add_argument(
        "--cases",
        default=",".join(c.key for c in DEFAULT_CASES),
        help="comma list of configurations to run (default: %(default)s; also available: "
        + ", ".join(c.key for c in EXTRA_CASES)
        + ")",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every simulated per-batch time (e.g. 0.5 halves them; default: 1)",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="each simulated cost varies uniformly by +-this fraction (default: 0, constant)",
    )
    parser.add_argument(
        "--cost-model",
        choices=("constant", "tokens", "work"),
        default="constant",
        help="simulated cost per batch: constant; tokens (both sides proportional to the "
        "batch's padded tokens); work, the realistic model (the target proportional to padded "
        "tokens, the drafter to the batch's block positions: anchors x block size per row) "
        "(default: constant)",
    )
    parser.add_argument(
        "--batching",
        choices=("work", "fixed"),
        default=PipelineOptions().batching,
        help="plan batches as train's --batching does (default: %(default)s, train's default)",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=0,
        help="train's --batch-tokens: the token cap of work batching, or with fixed batching "
        "rows per batch = N // bucket length (default: 0, unset)",
    )
    parser.add_argument(
        "--batch-cost",
        default="auto",
        help="train's --batch-cost: what work batching budgets by (auto: measured on a "
        "simulated drafter of each configuration, as train measures its first replica; blocks; "
        "tokens; or a token share in [0, 1]; train's default, flops, needs a real drafter's "
        "shape; default: %(default)s)",
    )
    parser.add_argument(
        "--mix",
        choices=MIX_MODES,
        default=PipelineOptions().mix,
        help="pull mode of the hidden-state queue (default: %(default)s, train's default)",
    )
    parser.add_argument(
        "--compare-mix",
        choices=MIX_MODES,
        default=None,
        help="run every configuration a second time, on the same plan, with this pull mode, "
        "and report --mix's rate as a ratio of it (rate_vs_mix; e.g. the plan order against "
        "the arrival-order stratified pull)",
    )
    add_seed_argument(parser)
    add_json_argument(parser)


def select_cases(keys: str, scale: float) -> list[PipelineCase]:
    by_key = {c.key: c for c in (*DEFAULT_CASES, *EXTRA_CASES)}
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in by_key]
    if unknown or not wanted:
        raise ValueError(f"--cases: unknown {unknown}; choose from {', '.join(by_key)}")
    if scale <= 0:
        raise ValueError(f"--scale must be positive, got {scale}")
    return [
        PipelineCase(
            c.key,
            c.targets,
            c.drafters,
            c.target_ms * scale,
            c.drafter_ms * scale,
            c.depth,
            c.min_ready,
            c.bytes_in_batches,
        )
        for c in (by_key[k] for k in wanted)
    ]


def main(args: argparse.Namespace) -> int:
    if args.seconds <= 0:
        raise ValueError(f"--seconds must be positive, got {args.seconds}")
    if args.batch_tokens < 0:
        raise ValueError(f"--batch-tokens must be >= 0, got {args.batch_tokens}")
    cases = select_cases(args.cases, args.scale)
    if args.batch_cost == "flops":
        raise ValueError(
            "--batch-cost flops counts a real drafter's FLOPs; this bench's drafters are "
            "simulated: give auto (measured on them), blocks, tokens or a share"
        )
    token_share = token_share_of(args.batch_cost)
    clock = SleepClock.calibrate()
    runs = [
        run_case(
            c,
            args.seconds,
            clock,
            jitter=args.jitter,
            cost_model=args.cost_model,
            batching=args.batching,
            batch_tokens=args.batch_tokens or None,
            token_share=token_share,
            mix=args.mix,
            seed=args.seed,
            compare_mix=args.compare_mix,
        )
        for c in cases
    ]
    report = BenchReport(
        title=(
            f"bench pipeline: steady-state batches/s vs the slower side's capacity "
            f"(sleep overshoot {clock.overshoot_s * 1e6:.0f} us calibrated away, cost "
            f"{args.cost_model}, batching {args.batching}, jitter {args.jitter:g}, mix {args.mix}"
            + (f", batch tokens {args.batch_tokens}" if args.batch_tokens else "")
            + (f", batch cost {args.batch_cost}" if args.batching == "work" else "")
            + ")"
        ),
        columns=[
            "case",
            "setup",
            "bound",
            "batches",
            "achieved_bps",
            "ideal_bps",
            "efficiency",
            "efficiency_nominal",
            "lockstep_bound",
            "token_share",
            "target_busy",
            "drafter_busy",
            *(["vs_mix_bps", "rate_vs_mix"] if args.compare_mix else []),
        ],
        rows=[r.row() for r in runs],
    )
    worst = min(runs, key=lambda r: r.steady_rate / r.ideal)
    report.summary = {
        "efficiency": min(r.steady_rate / r.ideal for r in runs),
        "efficiency_nominal": min(r.steady_rate / r.ideal_nominal for r in runs),
        "worst_case": worst.case.key,
        "sleep_overshoot_us": clock.overshoot_s * 1e6,
        "jitter": args.jitter,
        "cost_model": args.cost_model,
        "batching": args.batching,
        "batch_tokens": args.batch_tokens or None,
        "batch_cost": args.batch_cost,
        "token_share": sorted({r.token_share for r in runs}),
        "mix": args.mix,
        "accounting_ok": not any(r.problems for r in runs),
    }
    if args.compare_mix:
        ratios = [r.row()["rate_vs_mix"] for r in runs]
        report.summary["compare_mix"] = args.compare_mix
        report.summary["rate_vs_mix_min"] = min(ratios)
        report.summary["rate_vs_mix_geomean"] = float(np.exp(np.mean(np.log(ratios))))
    report.notes += [
        "efficiency = achieved / ideal with ideal from each side's measured seconds per batch; "
        "efficiency_nominal uses the configured seconds (charges late wake-ups on a busy machine)",
        "lockstep_bound = mean drafter cost / mean cost of the slowest of a step's batches: the "
        "most a lockstep step can reach when the drafters are the bottleneck",
    ]
    report.problems = [p for r in runs for p in r.problems]
    if any(math.isnan(r.steady_rate) for r in runs):
        report.problems.append("a configuration finished too few steps to measure a steady state")
    return emit(report, args.json)
