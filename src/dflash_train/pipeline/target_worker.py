"""Target workers: jobs -> the frozen target's selected-layer features -> the hidden-state queue.

Reader workers (`train --features`, `--cache-features`) stand in the same place and run the
same loop around a `FeatureReader` instead of a `FeatureSource`: the job queue, the accounting
("target": features produced), the hidden-state queue and its length mix do not know which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from dflash_train import faults
from dflash_train.devices import SegmentClock, enter_worker_thread
from dflash_train.pipeline.queue import END
from dflash_train.pipeline.records import HSBatch, Job
from dflash_train.pipeline.stages import Channels, FeatureReader, FeatureSource
from dflash_train.pipeline.workers import out_of_memory_named


@dataclass(frozen=True)
class _Stage:
    """What one feature worker runs: `features(job)` on `device`; `name` in the fault plan,
    `timer` its seconds, `what` its work in an out-of-memory message."""

    device: torch.device
    features: Callable[[Job], torch.Tensor]
    name: str
    timer: str
    what: str


def run_target_worker(source: FeatureSource, ch: Channels) -> None:
    """Until the job queue ends: the target's features of each job, onto the hidden-state
    queue (see `_run_feature_worker`)."""
    # A source with `features_of` reads more of the job than its token ids (the vLLM engine's:
    # the rows' lengths, by row id, so it computes no padding).
    features_of = getattr(source, "features_of", None)
    stage = _Stage(
        source.device,
        features_of or (lambda job: source(job.input_ids)),
        "target",
        "target_forward_s",
        "target forward",
    )
    _run_feature_worker(stage, ch)


def run_reader_worker(reader: FeatureReader, ch: Channels) -> None:
    """Until the job queue ends: each job's stored features, onto the hidden-state queue."""
    stage = _Stage(
        reader.device,
        lambda job: reader.read(job.seq_ids, job.input_ids, job.epoch, ch.stop),
        "reader",
        "feature_read_s",
        "feature read",
    )
    _run_feature_worker(stage, ch)


def _run_feature_worker(stage: _Stage, ch: Channels) -> None:
    """The features stay on the worker's device and are handed over without waiting for it:
    the work runs on this thread's own lane (stream), and the batch carries the lane's mark
    after it, which a drafter's copy waits for (`devices.handover`). Its time comes from CUDA
    events read once done (no wait; the host clock on CPU)."""
    lane = enter_worker_thread(stage.device)
    clock = SegmentClock(stage.device)
    while not ch.stop.is_set():
        job = ch.jobs.get()
        if job is END:
            return
        with out_of_memory_named(stage.device, stage.what, partial(_shape, job)):
            faults.point(stage.name)
            with clock.segment(stage.timer):
                features = stage.features(job)  # (batch, L, K * hidden) on the worker's device
        clock.end_group()
        for group in clock.harvest():
            ch.timers.add(stage.timer, group[stage.timer])
        ch.accounting.add("target", job.epoch, job.seq_ids)
        batch = HSBatch(job=job, features=features, ready=lane.mark())
        t1 = time.perf_counter()
        ch.hs_queue.put(batch, bucket=job.bucket, nbytes=batch.nbytes, seq=job.seq)
        ch.timers.add("target_put_wait_s", time.perf_counter() - t1)
        # The queue's: held here until the next forward returned, each worker's features
        # would lie on its device outside --hs-queue-bytes.
        del features, batch


def _shape(job: Job) -> str:
    """A job's batch, as an out-of-memory line names it."""
    rows, length = job.input_ids.shape
    return f"batch of {rows} x {length} tokens, bucket {job.bucket}"
