"""Target workers: jobs -> the frozen target's selected-layer features -> the hidden-state queue."""

from __future__ import annotations

import time

import torch

from dflash_train import faults
from dflash_train.devices import SegmentClock, enter_worker_thread
from dflash_train.pipeline.queue import END
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.stages import Channels, FeatureSource
from dflash_train.pipeline.workers import DeviceOutOfMemory


def run_target_worker(source: FeatureSource, ch: Channels) -> None:
    """Until the job queue ends: features of each job, put on the hidden-state queue.

    The features stay on the target device and are handed over without waiting for the device:
    the forward runs on this thread's own lane (stream), and the batch carries the lane's mark
    after it, which a drafter's copy waits for (`devices.handover`). The forward's time comes
    from CUDA events read once done (no wait; the host clock on CPU).
    """
    lane = enter_worker_thread(source.device)
    clock = SegmentClock(source.device)
    while not ch.stop.is_set():
        job = ch.jobs.get()
        if job is END:
            return
        try:
            faults.point("target")
            with clock.segment("target_forward_s"):
                features = source(job.input_ids)  # (batch, L, K * hidden) on the target device
        except torch.OutOfMemoryError as e:
            rows, length = job.input_ids.shape
            shape = f"batch of {rows} x {length} tokens, bucket {job.bucket}"
            raise DeviceOutOfMemory(source.device, "target forward", shape) from e
        clock.end_group()
        for group in clock.harvest():
            ch.timers.add("target_forward_s", group["target_forward_s"])
        ch.accounting.add("target", job.epoch, job.seq_ids)
        batch = HSBatch(job=job, features=features, ready=lane.mark())
        t1 = time.perf_counter()
        ch.hs_queue.put(batch, bucket=job.bucket, nbytes=batch.nbytes)
        ch.timers.add("target_put_wait_s", time.perf_counter() - t1)
