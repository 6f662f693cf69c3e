"""The interval metrics' hold on a step's device tensors (their ordering is recorded in
`tests/integration/test_lane_ordering.py`)."""

from __future__ import annotations

import threading
import weakref

import torch

from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.queue import BufferedHSQueue
from dflash_train.pipeline.sync import StepOutcome
from dflash_train.train.interval import IntervalMetrics


def outcome(loss: float) -> StepOutcome:
    block = 4
    return StepOutcome(
        step=0,
        global_weight=2.0,
        all_ended=False,
        jobs=[],
        loss_sum=torch.tensor(loss),
        correct=torch.ones(block),
        count=torch.full((block,), 2.0),
        sync_s=0.0,
    )


def test_a_steps_tensors_are_held_until_the_flush_has_read_them():
    # On CUDA the step's tensors were allocated on rank 0's lane: once the record is dropped
    # that lane may reuse their memory, while this thread's sums of them may not have run yet.
    metrics = IntervalMetrics({0: 1.0}, num_target_workers=1, num_drafters=1)
    step = outcome(3.0)
    norm = torch.tensor(0.5)
    refs = [weakref.ref(t) for t in (step.loss_sum, step.correct, step.count, norm)]
    metrics.add(step, norm)
    del step, norm
    assert all(r() is not None for r in refs)
    queue = BufferedHSQueue(4, 1, 1, stop_event=threading.Event())
    out = metrics.flush(StageTimers(), queue, lr=1e-3)
    assert out["train/loss"] == 1.5 and out["train/grad_norm"] == 0.5
    assert all(r() is None for r in refs)  # released once read
