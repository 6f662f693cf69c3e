"""Drafter workers: pull hidden-state batches, train their replica, meet every step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash_train import faults
from dflash_train.devices import Lane, enter_worker_thread, wait_for
from dflash_train.objective import LossOutput
from dflash_train.pipeline.queue import END
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.stages import Channels, Replica, StepListener, update_share
from dflash_train.pipeline.sync import Contribution
from dflash_train.pipeline.workers import out_of_memory_named


@dataclass
class DrafterTask:
    """Drafter `rank` of `world` on this node trains `replica` until `total_steps` updates or
    the end of the stream; rank 0 alone has the `listener`."""

    rank: int
    replica: Replica
    total_steps: int
    grad_accum: int
    listener: StepListener | None = None
    world: int = 1

    def ticket(self, step: int, micro: int) -> int:
        """The stream position this replica trains at its `step`-th step (counted from this
        pipeline's start) and micro-batch: micro-batch-major, so the first micro-batch of
        every replica comes first in the stream and all replicas start as soon as the
        stream's head has arrived. A function of the plan alone, never of thread timing."""
        return (step * self.grad_accum + micro) * self.world + self.rank


def run_drafter(task: DrafterTask, ch: Channels) -> None:
    """Train until `total_steps` steps or until every replica has seen the end of the stream.

    A replica that has seen END keeps joining the rendezvous with an empty contribution, so the
    others never wait for a batch that will not come. With the plan order, which batch it
    takes at each step is `task.ticket` (with an arrival-order pull the queue ignores it).
    Rank 0 records the ids of every committed step (exactly-once accounting) and then calls
    the listener.
    """
    replica, rank = task.replica, task.rank
    lane = enter_worker_thread(replica.device)
    ended = False
    exchanges = 0  # steps this replica has met the others at, in this pipeline
    while replica.step < task.total_steps and not ch.stop.is_set():
        contrib = Contribution(rank)
        for micro in range(task.grad_accum):
            if ended:
                break
            t0 = time.perf_counter()
            item = ch.hs_queue.get(ticket=task.ticket(exchanges, micro))
            ch.timers.add("drafter_get_wait_s", time.perf_counter() - t0)
            if item is END:
                ended = True
                break
            t1 = time.perf_counter()
            contrib.add(item.job, _micro_step(replica, item))
            item = None  # its features, freed now, not after the rendezvous and the listener
            ch.timers.add("drafter_micro_step_s", time.perf_counter() - t1)
        contrib.ended, contrib.ready = ended, lane.mark()
        t2 = time.perf_counter()
        outcome = ch.rendezvous.exchange(contrib)
        ch.timers.add("drafter_rendezvous_s", time.perf_counter() - t2)
        exchanges += 1
        if rank == 0:
            ch.timers.add("grad_sync_s", outcome.sync_s)
        if outcome.num_batches == 0:
            if outcome.all_ended or outcome.stop_requested:
                return
            continue
        t3 = time.perf_counter()
        wait_for(outcome.done, replica.device)  # the summed gradients, on this lane
        grad_norm = _apply(replica, rank, outcome.global_weight, lane, ch)
        t4 = time.perf_counter()
        ch.timers.add("drafter_apply_s", t4 - t3)
        if rank == 0:
            for job in outcome.jobs:
                ch.accounting.add("trained", job.epoch, job.seq_ids)
            if task.listener is not None:
                task.listener.on_step(outcome, grad_norm)
            ch.timers.add("drafter_listener_s", time.perf_counter() - t4)
        if outcome.all_ended or outcome.stop_requested:
            return  # a stop request ends every replica of every node after the same step


def _apply(
    replica: Replica, rank: int, global_weight: float, lane: Lane, ch: Channels
) -> torch.Tensor | None:
    """The optimizer step; with a split optimizer, its shares summed over the replicas between
    `apply` and `finish` (every replica meets there: the global weight is the same everywhere,
    so they all skip together when it is 0)."""
    with out_of_memory_named(replica.device, "drafter's optimizer step", lambda: "all parameters"):
        grad_norm = replica.apply(global_weight)
        if update_share(replica) is not None and global_weight > 0:
            assert ch.updates is not None, "a split optimizer needs the pipeline's exchange"
            done = ch.updates.exchange(rank, lane.mark())
            wait_for(done, replica.device)  # every replica's share, summed on this lane
            replica.finish()  # type: ignore[attr-defined]
    return grad_norm


def _micro_step(replica: Replica, batch: HSBatch) -> LossOutput | None:
    """One micro-step; a device out of memory becomes an error that names the batch's shape."""

    def shape() -> str:
        rows, length = batch.job.input_ids.shape
        return (
            f"batch of {rows} x {length} tokens, {batch.job.layout.num_blocks} blocks per "
            f"sequence, bucket {batch.job.bucket}"
        )

    with out_of_memory_named(replica.device, "drafter step", shape):
        faults.point("drafter_step")
        return replica.micro_step(batch)
