"""The contracts between the pipeline and what it runs, and the records its workers receive.

The pipeline moves batches and gradients; it knows nothing of training. It calls a few kinds of
object, each typed by a small protocol here and implemented elsewhere:

- `BatchPlan` and `JobBuilder` (prefetchers): the planned `BatchSpec`s, and each one -> a
  host-side `Job` (`pipeline.prefetch.EpochPlans`, `BatchBuilder`; benchmarks simulate them);
- `FeatureSource` (target workers): a job's token ids -> the target's selected-layer features
  (`model.target.TargetFeatureExtractor`);
- `FeatureReader` (reader workers, in the target workers' place): a job's row ids and token ids
  -> those rows' features from a feature store (`store.reader.StoreReader`, or the hybrid's
  `store.cache.CachingReader`, which computes what the store does not hold);
- `Replica` (drafter workers): a drafter copy that runs micro-steps, exposes the flat gradient
  buffer the rendezvous sums, and applies the summed update (`train.replica.DraftReplica`).

and, optionally, one `StepListener` that rank 0's drafter calls after every applied step (the
trainer's metrics, evaluation and checkpoints).

Every worker gets two arguments: its own task record (defined beside the worker) and the
`Channels` all workers share.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dflash_train.data.buckets import BatchSpec
from dflash_train.objective import LossOutput
from dflash_train.pipeline.monitor import Accounting, StageTimers
from dflash_train.pipeline.queue import BufferedHSQueue
from dflash_train.pipeline.records import HSBatch, Job
from dflash_train.pipeline.sync import StepOutcome, StepRendezvous, UpdateExchange


class BatchPlan(Protocol):
    """The planned batches of every epoch, in order (`pipeline.prefetch.EpochPlans`)."""

    num_rows: int
    epochs: int

    def iter_all(self) -> Iterator[BatchSpec]: ...


class JobBuilder(Protocol):
    """What a prefetcher calls: everything the target and drafter need for one planned batch."""

    def build(self, spec: BatchSpec) -> Job: ...


class FeatureSource(Protocol):
    """What a target worker calls: features of a batch, (batch, L, K * hidden) on `device`."""

    device: torch.device

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class FeatureReader(Protocol):
    """What a reader worker calls: the features of a job's rows (`seq_ids`, padded token ids
    `input_ids` (batch, L)) of the job's `epoch` (the hybrid's source of a row depends on it),
    (batch, L, K * hidden) on `device`; a wait inside ends when `stop` is set."""

    device: torch.device

    def read(
        self, seq_ids: np.ndarray, input_ids: torch.Tensor, epoch: int, stop: threading.Event
    ) -> torch.Tensor: ...


class Replica(Protocol):
    """What a drafter worker calls on its replica, once per micro-batch and once per step.

    `micro_step` backpropagates one batch's loss numerator into `flat_grad` (None: nothing
    supervised); the rendezvous then sums `flat_grad` across replicas in place; `apply` divides
    by the global weight, steps the optimizer and returns the pre-clip gradient norm (a device
    tensor; None when the update was skipped). `step` counts applied updates.

    A replica may split its optimizer's work with the others (`SplitReplica`).
    """

    device: torch.device
    step: int
    flat_grad: torch.Tensor

    def micro_step(self, batch: HSBatch) -> LossOutput | None: ...

    def apply(self, global_weight: float) -> torch.Tensor | None: ...


class SplitReplica(Replica, Protocol):
    """A replica that shares its optimizer's work with the others of each step: with
    `update_share` set it does only its share in `apply`, written into `update_share` (zeros
    elsewhere); the pipeline then sums `update_share` over the replicas
    (`sync.UpdateExchange`) and calls `finish`, which completes the step. `update_share` None:
    a whole step in `apply`, as any replica."""

    update_share: torch.Tensor | None

    def finish(self) -> None: ...


def update_share(replica: Replica) -> torch.Tensor | None:
    """The replica's `SplitReplica.update_share`, None for a replica that does not split."""
    return getattr(replica, "update_share", None)


class StepListener(Protocol):
    """Called on rank 0's drafter thread after every applied step; the other replicas wait at
    the next rendezvous meanwhile, so the weights cannot change under it."""

    def on_step(self, outcome: StepOutcome, grad_norm: torch.Tensor | None) -> None: ...


@dataclass
class Channels:
    """What every worker shares: the queues, the rendezvous, the counters and the stop event
    (and the optimizer's update exchange when the replicas split their optimizer's work)."""

    stop: threading.Event
    jobs: BufferedHSQueue[Job]
    hs_queue: BufferedHSQueue[HSBatch]
    rendezvous: StepRendezvous
    accounting: Accounting
    timers: StageTimers
    updates: UpdateExchange | None = None
