"""Drafter workers: pull hidden-state batches, train their replica, meet every step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dflash_train.devices import enter_worker_thread
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.queue import END, BufferedHSQueue
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.sync import Contribution, StepOutcome, StepRendezvous
from dflash_train.train.replica import DraftReplica


def run_drafter(
    rank: int,
    replica: DraftReplica,
    hs_queue: BufferedHSQueue[HSBatch],
    rendezvous: StepRendezvous,
    timers: StageTimers,
    stop: threading.Event,
    total_steps: int,
    grad_accum: int,
    after_step: Callable[[StepOutcome, object], None] | None = None,
) -> None:
    """Train until `total_steps` updates or until every replica has seen the end of the stream.

    A replica that has seen END keeps joining the rendezvous with an empty contribution, so the
    others never wait for a batch that will not come. `after_step(outcome, grad_norm)` runs on
    rank 0 after each applied update (metrics, evaluation, checkpoints).
    """
    enter_worker_thread(replica.device)
    ended = False
    while replica.step < total_steps and not stop.is_set():
        contrib = Contribution(rank)
        for _ in range(grad_accum):
            if ended:
                break
            t0 = time.perf_counter()
            item = hs_queue.get()
            timers.add("drafter_get_wait_s", time.perf_counter() - t0)
            if item is END:
                ended = True
                break
            contrib.add(item.job, replica.micro_step(item))
        contrib.ended = ended
        outcome = rendezvous.exchange(contrib)
        timers.add("grad_sync_s", outcome.sync_s if rank == 0 else 0.0, count=int(rank == 0))
        if outcome.num_batches == 0:
            if outcome.all_ended:
                return
            continue
        grad_norm = replica.apply(outcome.global_weight)
        if after_step is not None:
            after_step(outcome, grad_norm)
        if outcome.all_ended:
            return
