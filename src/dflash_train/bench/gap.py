"""`dflash-train bench gap`: where a whole training run's time goes, next to its step alone.

The run is the real trainer (`train.trainer.Trainer`: prefetchers, job queue, target workers,
the hidden-state queue, drafter replicas, rendezvous, optimizer, metrics, the final checkpoint)
for `--steps` optimizer steps on a prepared dataset: `--data DIR`, or rows generated here with
GSM8K's lengths (a log-normal fitted to GSM8K train's chats, 73-548 tokens, the answer's share
of each row supervised). The step alone is the same drafter (a fresh replica built as train
builds it) trained on the same planned batches, one after the other on the main thread, with
the target's features computed beforehand and not timed: what `bench step` times, at the run's
own shapes. It is measured before and after the run (the machine's load moves).

Each of the run's steps after the first `--skip` (at least 1: step 1 holds the pipeline's
start, which the step alone has no counterpart for; the step alone leaves out as many of its
first steps) is split with the pipeline's own stage timers (`pipeline.monitor.StageTimers`):
the drafter's forward + backward, the host work around them in the micro-step, waiting for
features, the rendezvous, the optimizer (and the host work around it), rank 0's listener (step
records, evaluation, checkpoints); what the timers do not cover is shown as unattributed, so
the parts add up to the wall time per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import BenchReport, add_json_argument, emit, synthetic_lengths
from dflash_train.bench.step import timed_step
from dflash_train.config import TrainConfig
from dflash_train.data.dataset import write_prepared
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.command import metrics_sink
from dflash_train.train.models import build_replicas
from dflash_train.train.trainer import Trainer

# SpecForge's baseline target (`../shared/baselines/specforge`): a random Qwen3 of this shape.
BASELINE_TARGET = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
}
# GSM8K train's chats in tokens (7,473 rows, 73-548 tokens, median ~186): a log-normal fitted to
# its character lengths / 3.2 + a chat template's ~35 tokens; the answer is 37-70% of a row.
GSM8K_MEDIAN, GSM8K_SIGMA, GSM8K_MIN, GSM8K_MAX = 186.0, 0.35, 73, 548
GSM8K_ANSWER_SHARE = (0.37, 0.70)

# (part, the stage timers it is made of: +added, -subtracted)
RUN_PARTS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("drafter forward + backward", ("drafter_forward_s", "drafter_backward_s"), ()),
    (
        "host work in the micro-step",
        ("drafter_micro_step_s",),
        ("drafter_forward_s", "drafter_backward_s"),
    ),
    ("optimizer", ("optimizer_s",), ()),
    ("host work around the optimizer", ("drafter_apply_s",), ("optimizer_s",)),
    ("waiting for features", ("drafter_get_wait_s",), ()),
    ("rendezvous", ("drafter_rendezvous_s",), ()),
    ("listener: records, eval, checkpoints", ("drafter_listener_s",), ()),
]
OFF_PATH = ("target_forward_s", "prefetch_s", "target_put_wait_s")
"""Other threads' seconds per step: not on the drafter's path, but on the same cores."""


def gsm8k_like_rows(num_rows: int, vocab: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random token rows with GSM8K's lengths; the last 37-70% of each (the answer) supervised."""
    lengths = synthetic_lengths(
        num_rows,
        seed,
        median=GSM8K_MEDIAN,
        sigma=GSM8K_SIGMA,
        min_len=GSM8K_MIN,
        max_len=GSM8K_MAX,
    )
    rng = np.random.default_rng([seed, 0x65A])
    rows = []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[n - round(rng.uniform(*GSM8K_ANSWER_SHARE) * n) :] = 1
        rows.append((rng.integers(0, vocab - 1, n), mask))  # vocab - 1: the mask token's id
    return rows


class GapTrainer(Trainer):
    """The trainer, recording after every step when it ended and every stage timer's totals."""

    marks: list[tuple[float, dict[str, float]]]

    def on_step(self, outcome, grad_norm) -> None:
        super().on_step(outcome, grad_norm)
        self.marks.append((time.perf_counter(), self.timers.snapshot()[0]))


@dataclass
class Window:
    """Seconds per step of the run's steps `first`..`last` (both after a step ended)."""

    steps: int
    wall_s: float
    parts: dict[str, float]
    off_path: dict[str, float]


def run_window(
    marks: list[tuple[float, dict[str, float]]], skip: int, drafters: int
) -> Window | None:
    """The steps after the first `skip` (>= 1: the window runs from the end of step `skip` to
    the end of the last): wall and parts per step, each drafter's mean (the drafters' timers
    are summed; in lockstep every drafter's wall is the step's)."""
    if skip < 1:
        raise ValueError(
            f"skip must be >= 1 (the window starts at the end of step skip), got {skip}"
        )
    if len(marks) < skip + 2:
        return None
    (t0, s0), (t1, s1) = marks[skip - 1], marks[-1]
    n = len(marks) - skip

    def delta(stages: tuple[str, ...]) -> float:
        return sum(s1.get(s, 0.0) - s0.get(s, 0.0) for s in stages) / n

    parts = {name: (delta(add) - delta(sub)) / drafters for name, add, sub in RUN_PARTS}
    wall = (t1 - t0) / n
    parts["unattributed"] = wall - sum(parts.values())
    return Window(n, wall, parts, {s: delta((s,)) for s in OFF_PATH})


def step_alone(trainer: Trainer, batches: list[HSBatch], skip: int) -> dict[str, float]:
    """`_step_alone` on a thread of its own, as the run's drafter trains on one (torch's
    intra-op pool of the main thread and of a worker thread behave differently under load)."""
    out: dict[str, float] = {}
    thread = threading.Thread(
        target=lambda: out.update(_step_alone(trainer, batches, skip)), name="step-alone"
    )
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("the step alone failed (its traceback is above)")
    return out


def _step_alone(trainer: Trainer, batches: list[HSBatch], skip: int) -> dict[str, float]:
    """Seconds per step of a fresh replica (as the trainer builds its own) on `batches`, the
    first `skip` untimed: wall (median and mean), and its forward + backward and optimizer."""
    timers = StageTimers()
    (replica,) = build_replicas(
        trainer.cfg, trainer.data, [trainer.drafter_devices[0]], trainer.total_steps, timers
    )
    walls, start = [], None
    for i, batch in enumerate(batches):
        if i == skip:
            replica.flush_timers()
            start = timers.snapshot()[0]
        seconds = timed_step(replica, batch)
        if i >= skip:
            walls.append(seconds)
    replica.flush_timers()
    end, n = timers.snapshot()[0], len(walls)
    assert start is not None and n, "the step alone needs more batches than --skip"
    compute = sum(end[s] - start[s] for s in ("drafter_forward_s", "drafter_backward_s")) / n
    return {
        "wall_s": statistics.median(walls),
        "mean_s": sum(walls) / n,
        "compute_s": compute,
        "optimizer_s": (end["optimizer_s"] - start["optimizer_s"]) / n,
    }


def planned_batches(trainer: Trainer, steps: int) -> list[HSBatch]:
    """The first `steps` planned batches with their target features (the batches a run with
    one drafter trains, in order: the plan order), computed here and not timed."""
    plans, builder, source = trainer.data.plans, trainer.data.builder, trainer.extractors[0]
    out = []
    for spec, _ in zip(plans.iter_all(), range(steps), strict=False):
        job = builder.build(spec)
        with torch.no_grad():
            out.append(HSBatch(job, source(job.input_ids)))
    return out


def train_config(args: argparse.Namespace, target: str, data: str, out: Path) -> TrainConfig:
    """The run: train's defaults, but one target worker and one drafter on the CPU with
    `--threads` intra-op threads, and the shapes of the flags."""
    layers: dict[str, Any] = {
        "target": target,
        "data": data,
        "out": str(out),
        "overwrite": True,
        "target_devices": ["cpu"],
        "drafter_devices": ["cpu"],
        "cpu_threads": args.threads,
        "draft_layers": args.draft_layers,
        "num_target_features": args.num_target_features or args.draft_layers,
        "num_anchors": args.num_anchors,
        "batch_size": args.batch_size,
        "batching": args.batching,
        "batch_cost": "blocks",  # planned alike every time (auto measures this machine)
        "max_steps": args.steps,
        "log_every": args.log_every,
        "progress": False,
        "seed": args.seed,
    }
    if args.mask_token_id is not None:
        layers["mask_token_id"] = args.mask_token_id
    elif args.target is None:
        layers["mask_token_id"] = BASELINE_TARGET["vocab_size"] - 1
    return TrainConfig.from_layers(layers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        help="target model directory (default: a random Qwen3 of SpecForge's baseline shape, "
        "width 256, 8 layers, vocab 2048, made in a temporary directory)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="a prepared dataset (default: --rows random rows with GSM8K's lengths)",
    )
    parser.add_argument("--rows", type=int, default=2000, help="rows generated (default: 2000)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: 30)")
    parser.add_argument(
        "--skip",
        type=int,
        default=5,
        help="first steps left out of the run's split and of the step alone, at least 1: the "
        "run's step 1 holds the pipeline's start, reported apart as first_step_s (default: 5)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads (default: 2)"
    )
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--num-target-features", type=int, default=None)
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--batching", choices=("work", "fixed"), default="fixed")
    parser.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="train's --mask-token-id (default: the generated target's last id; with --target, "
        "train's own rule)",
    )
    parser.add_argument("--log-every", type=int, default=10, help="train's --log-every")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="show the trainer's log lines")
    add_json_argument(parser)


def _check(args: argparse.Namespace) -> None:
    for name in ("rows", "steps", "threads", "batch_size", "num_anchors", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.steps < 3:
        raise ValueError(
            f"--steps must be >= 3 (--skip >= 1 warm-up step, then 2 measured), got {args.steps}"
        )
    if not 1 <= args.skip <= args.steps - 2:
        raise ValueError(
            f"--skip must be in 1..{args.steps - 2} (--steps {args.steps}): step 1 holds the "
            "pipeline's start, and at least 2 steps are measured"
        )
    for name in ("target", "data"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"--{name} {path}: no such directory")


def main(args: argparse.Namespace) -> int:
    _check(args)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-gap-") as tmp:
        root = Path(tmp)
        target = args.target or str(save_random_qwen3(root / "target", **BASELINE_TARGET))
        data = args.data
        if data is None:
            vocab = BASELINE_TARGET["vocab_size"] if args.target is None else 2**31
            rows = gsm8k_like_rows(args.rows, min(vocab, _target_vocab(target)), args.seed)
            data = str(root / "data")
            write_prepared(data, rows)
        return _measure(args, train_config(args, target, data, root / "run"))


def _target_vocab(target: str) -> int:
    from dflash_train.model.target import load_target_config

    return int(load_target_config(target).vocab_size)


def _measure(args: argparse.Namespace, cfg: TrainConfig) -> int:
    say = print if args.verbose else (lambda _msg: None)
    trainer = GapTrainer(cfg, log=say, sink_factory=metrics_sink(cfg))
    trainer.marks = []
    t0 = time.perf_counter()
    trainer.build()
    build_s = time.perf_counter() - t0
    batches = planned_batches(trainer, args.steps)
    before = step_alone(trainer, batches, args.skip)
    t1 = time.perf_counter()
    result = trainer.run()
    run_s = time.perf_counter() - t1
    after = step_alone(trainer, batches, args.skip)
    window = run_window(trainer.marks, args.skip, len(trainer.replicas))
    report = _report(args, window, [before, after], result.steps, run_s)
    if trainer.marks:
        # The whole run = the first step (the pipeline's start and fill-up included) + the
        # steps after it + the end (stopping the threads, accounting, the final checkpoint).
        report.summary.update(
            build_s=build_s,
            first_step_s=trainer.marks[0][0] - t1,
            end_s=t1 + run_s - trainer.marks[-1][0],
        )
    if "all match" not in result.accounting:
        report.problems.append(result.accounting)
    return emit(report, args.json)


def _report(
    args: argparse.Namespace,
    window: Window | None,
    alone: list[dict[str, float]],
    steps: int,
    run_s: float,
) -> BenchReport:
    report = BenchReport(
        title=(
            f"bench gap: the run's seconds per step, part by part, next to its step alone "
            f"({args.threads} threads, {args.draft_layers}-layer drafter, "
            f"{args.num_anchors} anchors, {args.batching} batches of {args.batch_size}, "
            f"steps {args.skip + 1}-{args.steps})"
        ),
        columns=["part", "run_s", "step_s", "gap_s", "share_of_gap"],
    )
    if window is None:
        report.problems.append(f"the run trained {steps} steps: too few to measure")
        return report
    mean = {k: statistics.mean(a[k] for a in alone) for k in alone[0]}
    step_parts = dict.fromkeys(window.parts, 0.0)
    step_parts["drafter forward + backward"] = mean["compute_s"]
    step_parts["optimizer"] = mean["optimizer_s"]
    step_parts["host work in the micro-step"] = mean["mean_s"] - mean["compute_s"]
    step_parts["host work in the micro-step"] -= mean["optimizer_s"]
    gap = window.wall_s - mean["mean_s"]
    for name, run_part in window.parts.items():
        d = run_part - step_parts[name]
        report.rows.append(
            {
                "part": name,
                "run_s": run_part,
                "step_s": step_parts[name],
                "gap_s": d,
                "share_of_gap": d / gap if gap else float("nan"),
            }
        )
    report.rows.append(
        {"part": "total", "run_s": window.wall_s, "step_s": mean["mean_s"], "gap_s": gap}
    )
    report.summary = {
        "run_steps_per_s": 1 / window.wall_s,
        "step_steps_per_s": 1 / mean["mean_s"],
        "run_vs_step": mean["mean_s"] / window.wall_s,
        "step_s_before_run": alone[0]["mean_s"],
        "step_s_after_run": alone[1]["mean_s"],
        "whole_run_steps_per_s": steps / run_s,
        "whole_run_vs_step": steps * mean["mean_s"] / run_s,
        "steps": steps,
        "window_steps": window.steps,
        **{f"off_path_{k}": v for k, v in window.off_path.items()},
    }
    report.notes += [
        "run_s: seconds per step of the run's drafter, by stage timer; step_s: the same "
        "batches trained alone on a thread (bench step's timing), the mean of before and after "
        "the run; the step alone's host work includes the work around its optimizer",
        "whole_run_*: every step from trainer.run()'s start to its return (first_step_s: the "
        "start and the first step; end_s: after the last step)",
        "off_path_*: other threads' seconds per step (target workers, prefetchers) on the "
        "same cores: they slow the drafter's compute, they are not on its path",
    ]
    return report
