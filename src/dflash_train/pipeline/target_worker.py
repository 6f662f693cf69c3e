"""Target workers: jobs -> the frozen target's selected-layer features -> the hidden-state queue."""

from __future__ import annotations

import threading
import time

import torch

from dflash_train.devices import enter_worker_thread, synchronize
from dflash_train.model.target import TargetFeatureExtractor
from dflash_train.pipeline.monitor import Accounting, StageTimers
from dflash_train.pipeline.queue import END, BufferedHSQueue
from dflash_train.pipeline.records import HSBatch, Job


def run_target_worker(
    extractor: TargetFeatureExtractor,
    jobs: BufferedHSQueue[Job],
    hs_queue: BufferedHSQueue[HSBatch],
    accounting: Accounting,
    timers: StageTimers,
    stop: threading.Event,
) -> None:
    """Until the job queue ends: features of each job, put on the hidden-state queue.

    The features stay on the target device. The worker waits for its own kernels before handing
    them over, so a drafter thread can copy them without sharing streams.
    """
    enter_worker_thread(extractor.device)
    while not stop.is_set():
        job = jobs.get()
        if job is END:
            return
        t0 = time.perf_counter()
        features = extractor(job.input_ids)
        synchronize(extractor.device)
        dt = time.perf_counter() - t0
        timers.add("target_forward_s", dt)
        accounting.add("target", job.epoch, job.seq_ids)
        batch = HSBatch(job=job, features=features, target_s=dt)
        t1 = time.perf_counter()
        hs_queue.put(batch, bucket=job.bucket, nbytes=batch.nbytes)
        timers.add("target_put_wait_s", time.perf_counter() - t1)


def features_nbytes(
    batch: int, length: int, num_features: int, hidden: int, dtype: torch.dtype
) -> int:
    """Bytes of one batch of hidden states (for sizing --hs-queue-bytes)."""
    return batch * length * num_features * hidden * torch.empty((), dtype=dtype).element_size()
