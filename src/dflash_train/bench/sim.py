"""Simulated pipeline stages: the real workers, queues and rendezvous, with compute replaced by
calibrated sleeps.

`time.sleep` releases the GIL like a CUDA kernel launch-and-wait does, so the threads overlap the
way GPU workers do; what the benchmark then measures is the machinery in between (queues,
readiness gate, lockstep, accounting). The fakes implement the pipeline's stage protocols
(`pipeline/stages.py`):

- `SimulatedExtractor` is a `FeatureSource` (it stands in for `TargetFeatureExtractor`);
- `SimulatedReplica` is a `Replica` (for `DraftReplica`);
- `SimulatedBuilder` is a `JobBuilder` (for `BatchBuilder`);
- `StepLog` is the `StepListener` that timestamps every applied step.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash_train.data.buckets import BatchSpec
from dflash_train.objective import blocks_per_row
from dflash_train.pipeline.queue import BufferedHSQueue
from dflash_train.pipeline.records import HSBatch, Job
from dflash_train.pipeline.sync import StepOutcome

CPU = torch.device("cpu")


@dataclass(frozen=True)
class SleepClock:
    """Sleeps of a requested length: `time.sleep` wakes late by a roughly constant overshoot
    (timer slack plus scheduling), so the overshoot measured at start-up is subtracted."""

    overshoot_s: float = 0.0

    @classmethod
    def calibrate(cls, probe_s: tuple[float, ...] = (0.002, 0.01, 0.03), repeats: int = 8):
        """Median overshoot of `time.sleep` over a few lengths around the simulated ones."""
        over = []
        for d in probe_s:
            for _ in range(repeats):
                t0 = time.perf_counter()
                time.sleep(d)
                over.append(time.perf_counter() - t0 - d)
        return cls(max(0.0, statistics.median(over)))

    def now(self) -> float:
        """The clock the simulated stages are timed by (seconds)."""
        return time.perf_counter()

    def sleep(self, seconds: float) -> float:
        """Sleep about `seconds`; returns the seconds actually spent."""
        t0 = time.perf_counter()
        if seconds > 0:
            time.sleep(max(0.0, seconds - self.overshoot_s))
        return time.perf_counter() - t0


@dataclass
class ServiceLog:
    """Seconds each call of one simulated stage actually took (one writer thread per log)."""

    seconds: list[float] = field(default_factory=list)

    def total(self) -> float:
        return float(sum(self.seconds))

    def mean(self) -> float:
        return float(np.mean(self.seconds)) if self.seconds else float("nan")


class Cost:
    """A per-batch cost in seconds: nominal, times a uniform factor in [1 - jitter, 1 + jitter].

    With `per_unit` set (the mean size of a batch in the stage's unit of work: padded tokens, or
    the drafter's block positions), the nominal cost is for a batch of that size and scales with
    each batch's size, as GPU work roughly does: long batches cost more than short ones, at the
    same mean.
    """

    def __init__(
        self, seconds: float, jitter: float = 0.0, seed: int = 0, per_unit: float | None = None
    ) -> None:
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        if seconds < 0 or (per_unit is not None and per_unit <= 0):
            raise ValueError("seconds must be >= 0 and per_unit positive")
        self.seconds, self.jitter, self.per_unit = seconds, jitter, per_unit
        self._rng = random.Random(seed)

    def draw(self, units: int) -> float:
        base = self.seconds
        if self.per_unit is not None:
            base *= units / self.per_unit
        if self.jitter == 0:
            return base
        return base * self._rng.uniform(1 - self.jitter, 1 + self.jitter)


class SimulatedExtractor:
    """A target device whose forward costs `cost` and returns `feature_bytes` per padded
    token."""

    def __init__(self, clock: SleepClock, cost: Cost, *, feature_bytes: int = 4) -> None:
        self.device = CPU
        self.clock = clock
        self.cost = cost
        self.feature_bytes = feature_bytes
        self.log = ServiceLog()

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.log.seconds.append(self.clock.sleep(self.cost.draw(input_ids.numel())))
        # (rows, padded_len) -> bytes proportional to the padded tokens, so a byte bound on the
        # queue sees long buckets as larger, like real hidden states.
        return torch.empty(input_ids.numel() * self.feature_bytes, dtype=torch.uint8)


class SimulatedReplica:
    """A drafter device whose micro-step costs `cost` per batch, scaled (when the cost has a
    `per_unit`) by the batch's padded tokens (`unit="tokens"`) or its block positions
    (`unit="blocks"`: anchors x block size per row, what the drafter's layers run on)."""

    def __init__(self, clock: SleepClock, cost: Cost, unit: str = "tokens") -> None:
        if unit not in ("tokens", "blocks"):
            raise ValueError(f"unit must be tokens or blocks, got {unit!r}")
        self.device = CPU
        self.clock = clock
        self.cost, self.unit = cost, unit
        self.step = 0
        self.flat_grad = torch.zeros(8)  # what the rendezvous sums across replicas
        self.log = ServiceLog()
        self.batches = 0

    def micro_step(self, batch: HSBatch) -> None:
        job = batch.job
        units = job.input_ids.numel() if self.unit == "tokens" else job.block_ids.numel()
        self.log.seconds.append(self.clock.sleep(self.cost.draw(units)))
        self.batches += 1
        self.flat_grad.add_(1.0)
        return None  # no loss statistics: the rendezvous then reduces only weights and jobs

    def apply(self, global_weight: float) -> None:
        if global_weight <= 0:
            self.flat_grad.zero_()
            return None
        self.flat_grad.zero_()
        self.step += 1
        return None


def simulated_job(
    spec: BatchSpec, lengths: np.ndarray, bucket_len: int, block_positions: int = 0
) -> Job:
    """A `Job` carrying only what the queues, workers and accounting read.

    input_ids is (rows, bucket_len) so the simulated features scale with the padded tokens;
    block_ids is (rows, block_positions) as a real job's (its blocks x block size); layout and
    targets stay None: the simulated stages never read them.
    """
    rows = len(spec.seq_ids)
    real = int(lengths[list(spec.seq_ids)].sum())
    return Job(
        epoch=spec.epoch,
        index=spec.index,
        bucket=spec.bucket,
        seq_ids=np.asarray(spec.seq_ids, dtype=np.int64),
        input_ids=torch.zeros((rows, bucket_len), dtype=torch.int8),
        block_ids=torch.zeros((rows, block_positions), dtype=torch.int8),
        layout=None,  # type: ignore[arg-type]
        targets=None,  # type: ignore[arg-type]
        weight_sum=float(rows),
        num_tokens=real,
        num_padded=rows * bucket_len - real,
        prefetch_s=0.0,
    )


@dataclass
class SimulatedBuilder:
    """Builds `simulated_job`s: the prefetchers' host work is not what is being measured.

    With `anchors` (per row), each job's block positions are the real rule's: the batch's
    largest anchor count rounded up to a power of two, times the block size, per row.
    """

    lengths: np.ndarray
    bucket_lengths: list[int]
    anchors: np.ndarray | None = None
    block_size: int = 16
    num_anchors: int = 512

    def build(self, spec: BatchSpec) -> Job:
        positions = 0
        if self.anchors is not None:
            most = int(self.anchors[list(spec.seq_ids)].max())
            positions = blocks_per_row(most, self.num_anchors) * self.block_size
        return simulated_job(spec, self.lengths, self.bucket_lengths[spec.bucket], positions)


class StepLog:
    """Time, batches and buckets of every applied optimizer step: rank 0's step listener."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.batches: list[int] = []
        self.buckets: list[list[int]] = []
        self.batch_keys: list[tuple[int, int]] = []  # (epoch, index) of every trained batch
        self._lock = threading.Lock()

    def on_step(self, outcome: StepOutcome, grad_norm: torch.Tensor | None) -> None:
        with self._lock:
            self.times.append(time.perf_counter())
            self.batches.append(len(outcome.jobs))
            self.buckets.append([j.bucket for j in outcome.jobs])
            self.batch_keys.extend((j.epoch, j.index) for j in outcome.jobs)


def steady_rate(
    times: list[float], batches: list[int], skip_head: float = 0.2, skip_tail: float = 0.1
) -> tuple[float, float, int]:
    """Batches/s between two step completions, leaving out the fill-up at the start and the
    drain at the end: (rate, window seconds, steps in the window).

    Counting from one step's completion to another's avoids the quantisation of counting whole
    steps in a fixed time window (one 7-batch step is several % of a short window).
    """
    n = len(times)
    if n < 3:
        return float("nan"), 0.0, 0
    i = min(n - 2, int(n * skip_head))
    j = max(i + 1, int(n * (1 - skip_tail)) - 1)
    span = times[j] - times[i]
    done = sum(batches[i + 1 : j + 1])
    return (done / span if span > 0 else float("nan")), span, j - i


def lockstep_bound(cost: Cost, units: np.ndarray, drafters: int, seed: int = 0) -> float:
    """Best drafter-side efficiency lockstep allows: mean cost / E[max cost of the `drafters`
    batches of one step] (a step lasts as long as its slowest replica), by sampling steps of
    batches drawn at random from the plan; `units` is each planned batch's size in the cost's
    unit."""
    rng = np.random.default_rng(seed)
    probe = Cost(cost.seconds, cost.jitter, seed + 1, cost.per_unit)
    draws = np.array(
        [[probe.draw(int(t)) for t in rng.choice(units, drafters)] for _ in range(2000)]
    )
    return float(draws.mean() / draws.max(axis=1).mean())


class QueueSampler:
    """Samples the hidden-state queue's depth, bytes and per-bucket depth every `every_s`."""

    def __init__(self, queue: BufferedHSQueue, every_s: float = 0.05) -> None:
        self.queue, self.every_s = queue, every_s
        self.samples: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._done.wait(self.every_s):
            s = self.queue.stats()
            self.samples.append(
                {
                    "t": time.perf_counter() - t0,
                    "depth": s.depth,
                    "bytes": s.bytes,
                    "buckets": s.bucket_depth,
                    "alive": s.producers_alive,
                }
            )

    def mean(self, key: str) -> float:
        """Mean of `key` while every producer was alive (the steady part of the run)."""
        vals = [x[key] for x in self.samples if x["alive"] == self.queue.num_producers]
        return sum(vals) / len(vals) if vals else float("nan")
