"""Lockstep of drafter replicas: one rendezvous per optimizer step, without the classic hang.

Every replica calls `exchange(contribution)` once per step, whether it trained on batches, got a
batch with nothing to supervise, or has already seen the end of the stream (then it contributes
zero gradients and zero weight). The LAST replica to arrive sums the gradient buffers across
replicas (writing the sum back into each), sums the host-side weight sums and counts, and wakes
the others; all then apply identical updates. The outcome says whether every replica has now
seen the end of the stream, which makes that step the last one.

Waits poll the stop event and fail after `stall_timeout_s` naming the replicas that never came.
That timeout breaks the lockstep for good (as a broken `threading.Barrier`): every other waiter
and every later exchange raises the same TimeoutError, so a late replica cannot complete the step
with the departed one's stale contribution and apply an update the departed never applies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from dflash_train import faults
from dflash_train.devices import Mark, marks_here, wait_for
from dflash_train.objective import LossOutput
from dflash_train.pipeline.distributed import NodeGroup
from dflash_train.pipeline.queue import QueueStopped
from dflash_train.pipeline.records import Job

R = TypeVar("R")


@dataclass
class Contribution:
    """What one replica did in one step (host numbers, plus its device-side loss stats).

    `ready`: the replica's lane mark after its backward passes; the reduce waits for it before
    it reads the replica's gradients and losses (None: nothing queued on another stream).
    """

    rank: int
    ended: bool = False
    weight_sum: float = 0.0
    jobs: list[Job] = field(default_factory=list)
    losses: list[LossOutput] = field(default_factory=list)
    ready: Mark | None = None

    def add(self, job: Job, loss: LossOutput | None) -> None:
        self.jobs.append(job)
        # On-policy anchors: the replica knew the batch's divisor only after its rounds, and
        # brings it here as a host number, summed with everyone's before anyone divides.
        own = None if loss is None else loss.normaliser
        self.weight_sum += job.weight_sum if own is None else own
        if loss is not None:
            self.losses.append(loss)


@dataclass
class StepOutcome:
    """The reduced step, identical for every replica.

    loss_sum, correct, count, pos_weight (and selector, DFlash 2's (4, B) statistics, else
    None): device tensors on the first replica's device (summed over all replicas and
    micro-batches); everything else is host data. `done`: marks after the reduce on every
    replica's device; a replica waits for its device's before it reads its summed gradients or
    the loss statistics (`devices.wait_for(outcome.done, device)`).
    """

    step: int
    global_weight: float
    all_ended: bool
    jobs: list[Job]
    """This node's batches of the step (what its accounting records)."""
    loss_sum: torch.Tensor | None
    correct: torch.Tensor | None
    count: torch.Tensor | None
    sync_s: float
    global_batches: int = -1
    """Batches of the step on every node (-1: one node, then the same as num_batches)."""
    selector: torch.Tensor | None = None
    pos_weight: torch.Tensor | None = None
    """(B,) the sum of the unary term's position weights per block offset."""
    done: list[Mark] = field(default_factory=list)
    rounds: tuple[int, int, int] | None = None
    """On-policy anchors: this node's verify rounds of the step, the tokens they emitted and
    their rejected drafts (host counts, summed over its replicas; None with random anchors)."""
    rejected: torch.Tensor | None = None
    """On-policy anchors: (1,) this node's rejected-draft stream's weighted sum (in loss_sum)."""
    stop_requested: bool = False
    """Some node asked to stop (`StepRendezvous.stop_request`): every replica of every node
    applies this step and ends, so all stop at the same step."""

    @property
    def num_batches(self) -> int:
        """Batches of the step everywhere: zero means no replica anywhere had one."""
        return len(self.jobs) if self.global_batches < 0 else self.global_batches


def _round_stats(
    losses: list[LossOutput], dev: torch.device
) -> tuple[tuple[int, int, int] | None, torch.Tensor | None]:
    """On-policy: the replicas' round counts summed (host) and their rejected streams' sums
    (on `dev`, in replica order); (None, None) with random anchors."""
    counted = [x.rounds for x in losses if x.rounds is not None]
    if not counted:
        return None, None
    rounds = tuple(sum(c[i] for c in counted) for i in range(3))
    parts = [x.rejected.to(dev) for x in losses if x.rejected is not None]
    rejected = sum(parts[1:], parts[0]) if parts else None
    return rounds, rejected  # type: ignore[return-value]


def sum_into_all(buffers: list[torch.Tensor]) -> None:
    """All-reduce (sum) of same-shaped buffers on any devices, in place, identical everywhere.

    One GPU per buffer: one NCCL all-reduce over the node's devices (`torch.cuda.nccl`), in
    place, queued on each device's current stream of the calling thread, which is where the
    rendezvous made it wait for each replica's mark and where it marks the result. NCCL's
    all-reduce hands every rank the same reduced values. (Summing through the first device
    instead was 2 (N - 1) full-buffer copies, each after the previous add, and a temporary of
    every buffer's size on that device.) Otherwise (CPU, or a mix): the sum is formed on the
    first buffer's device in replica order and copied back, bit-identical everywhere.
    """
    if len(buffers) == 1:
        return
    if _nccl_reduces(buffers):
        torch.cuda.nccl.all_reduce(buffers)
        return
    total = buffers[0].clone()
    for b in buffers[1:]:
        total.add_(b.to(total.device))
    for b in buffers:
        b.copy_(total)


def _nccl_reduces(buffers: list[torch.Tensor]) -> bool:
    """Whether NCCL can sum `buffers` in one collective: each contiguous, on its own GPU."""
    if not all(b.is_cuda for b in buffers):
        return False
    return torch.cuda.nccl.is_available(buffers)


class Meeting(Generic[R]):
    """A reusable barrier for `world` parties whose LAST arrival computes the outcome every
    party returns (`reduce` over the payloads, by rank).

    Waits poll the stop event and fail after `stall_timeout_s` naming the parties that never
    came; that timeout breaks the meeting for good (as a broken `threading.Barrier`), so a late
    party cannot complete a round with a departed one's stale payload.
    """

    def __init__(
        self,
        world: int,
        stop_event: threading.Event,
        stall_timeout_s: float,
        reduce: Callable[[list[Any]], R],
        poll_s: float = 0.05,
        what: str = "drafter replicas",
        abort: Callable[[], bool] | None = None,
    ) -> None:
        """`abort`: what ends the meeting early in place of the stop event, for a meeting that
        must complete once its parties have begun (a stop request alone does not end it)."""
        self.world, self.stop_event, self.stall_timeout_s = world, stop_event, stall_timeout_s
        self._reduce, self.poll_s, self.what = reduce, poll_s, what
        self._abort = abort or stop_event.is_set
        self._cond = threading.Condition()
        self._pending: dict[int, Any] = {}
        self._generation = 0
        self._outcome: R | None = None
        self.rounds = 0
        self._broken: str | None = None  # why no round can complete any more (a stall)

    def meet(self, rank: int, payload: Any) -> R:
        with self._cond:
            if self._abort():
                # A stopped run completes no more rounds: a party that already left must not
                # complete one the others then act on without it.
                raise QueueStopped(f"stopped before the {self.what}' meeting")
            if self._broken is not None:
                raise TimeoutError(self._broken)
            if rank in self._pending:
                raise RuntimeError(f"{self.what}: {rank} arrived twice in one round")
            gen = self._generation
            self._pending[rank] = payload
            if len(self._pending) == self.world:
                self._outcome = self._reduce([self._pending[r] for r in range(self.world)])
                self._pending = {}
                self._generation += 1
                self.rounds += 1
                self._cond.notify_all()
                return self._outcome
            self._wait(gen)
            assert self._outcome is not None
            return self._outcome

    def _wait(self, gen: int) -> None:
        deadline = time.monotonic() + self.stall_timeout_s
        while self._generation == gen:
            if self._abort():
                raise QueueStopped(f"stopped while waiting for the other {self.what}")
            if self._broken is not None:
                raise TimeoutError(self._broken)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(self._pending))
                self._broken = (
                    f"{self.what} {missing} did not reach step {self.rounds} within "
                    f"{self.stall_timeout_s:.0f}s"
                )
                self._cond.notify_all()
                raise TimeoutError(self._broken)
            self._cond.wait(self.poll_s)


class StepRendezvous:
    """A reusable barrier for `world` replicas that reduces their gradients on the way out."""

    def __init__(
        self,
        grad_buffers: list[torch.Tensor],
        stop_event: threading.Event,
        stall_timeout_s: float,
        reduce: Callable[[list[torch.Tensor]], None] = sum_into_all,
        poll_s: float = 0.05,
        nodes: NodeGroup | None = None,
        loss_stats_size: int = 0,
        loss_stat_rows: int = 3,
        stop_request: threading.Event | None = None,
    ) -> None:
        """`stop_request`: set (by any node) to end the run after the next step everywhere;
        unlike `stop_event`, the step in flight completes, so nodes agree on the last step."""
        self.world = len(grad_buffers)
        self.stop_request = stop_request or threading.Event()
        self.grad_buffers = grad_buffers
        self.stop_event, self.stall_timeout_s = stop_event, stall_timeout_s
        self.reduce, self.poll_s = reduce, poll_s
        # Across nodes: the gradients, the loss statistics (1 + 3 x block size numbers, plus
        # 4 x block size for DFlash 2's selector) and 3 host numbers.
        self.nodes, self.loss_stats_size = nodes, loss_stats_size
        self.block_size = max(0, loss_stats_size - 1) // loss_stat_rows
        self._meeting = Meeting(self.world, stop_event, stall_timeout_s, self._reduce, poll_s)
        self._ended = np.zeros(self.world, dtype=bool)
        self._step = 0

    @property
    def steps(self) -> int:
        """Steps reduced so far that carried at least one batch."""
        return self._step

    def exchange(self, contribution: Contribution) -> StepOutcome:
        faults.point("rendezvous")
        return self._meeting.meet(contribution.rank, contribution)

    def _reduce(self, contribs: list[Contribution]) -> StepOutcome:
        t0 = time.perf_counter()
        # This thread reads what every replica's lane wrote: wait for each (no host wait).
        wait_for([c.ready for c in contribs if c.ready is not None])
        self.reduce(self.grad_buffers)
        for c in contribs:
            self._ended[c.rank] |= c.ended
        losses = [loss for c in contribs for loss in c.losses]
        dev = self.grad_buffers[0].device
        loss_sum = correct = count = selector = pos_weight = None
        if losses:
            loss_sum = sum(x.loss_sum.to(dev) for x in losses)
            correct = sum(x.correct.to(dev) for x in losses)
            count = sum(x.count.to(dev) for x in losses)
            if losses[0].selector is not None:  # every replica trains the same architecture
                selector = sum(x.selector.to(dev) for x in losses)
            if losses[0].pos_weight is not None:
                pos_weight = sum(x.pos_weight.to(dev) for x in losses)
        rounds, rejected = _round_stats(losses, dev)
        jobs = [j for c in contribs for j in c.jobs]
        weight = sum(c.weight_sum for c in contribs)
        not_ended = int((~self._ended).sum())
        batches = -1
        stop = self.stop_request.is_set()  # read once: the value this node adds to the sum
        if self.nodes is not None:
            weight, batches, not_ended, stop, stats = self._across_nodes(
                weight, len(jobs), not_ended, stop, loss_sum, correct, count, pos_weight, selector
            )
            loss_sum, correct, count, pos_weight, selector = stats
        outcome = StepOutcome(
            step=self._step,
            global_weight=weight,
            all_ended=not_ended == 0,
            jobs=jobs,
            loss_sum=loss_sum,
            correct=correct,
            count=count,
            sync_s=time.perf_counter() - t0,
            global_batches=batches,
            selector=selector,
            pos_weight=pos_weight,
            done=marks_here([b.device for b in self.grad_buffers]),
            stop_requested=stop,
            rounds=rounds,
            rejected=rejected,
        )
        if outcome.num_batches:
            self._step += 1
        return outcome

    def _across_nodes(
        self, weight, batches, not_ended, stop, loss_sum, correct, count, pos_weight, selector
    ):
        """Sum the node's step with every other node's: host numbers (the stop request among
        them: the step after which every node stops is the first any node asked for),
        gradients, statistics (1 + 3 x block size numbers, + 4 x block size for DFlash 2's
        selector). Every node calls this exactly once per step, so the collectives pair up."""
        assert self.nodes is not None
        weight, batches, not_ended, stops = self.nodes.sum_step_numbers(
            [weight, float(batches), float(not_ended), float(stop)]
        )
        first = self.grad_buffers[0]
        self.nodes.sum_device(first)
        for b in self.grad_buffers[1:]:
            b.copy_(first)  # every local replica holds the global sum too
        stats = torch.zeros(self.loss_stats_size, device=first.device)
        if loss_sum is not None:
            if pos_weight is None:  # a loss without position-weight sums (faked in tests)
                pos_weight = torch.zeros_like(count)
            parts = [loss_sum.reshape(1).float(), correct.float(), count.float()]
            parts.append(pos_weight.float())
            stats = torch.cat(parts + ([] if selector is None else [selector.flatten().float()]))
        self.nodes.sum_device(stats)
        size = self.block_size
        loss_stats = (None, None, None, None, None)
        if batches > 0 and size:
            per_offset = stats[1 : 1 + 3 * size].view(3, size)
            sel = stats[1 + 3 * size :]
            loss_stats = (
                stats[0],
                per_offset[0],
                per_offset[1],
                per_offset[2],
                sel.view(-1, size) if sel.numel() else None,
            )
        return weight, int(batches), int(not_ended), stops > 0, loss_stats


class UpdateExchange:
    """The second meeting of a step, for replicas that split their optimizer's work
    (`Replica.update_share`): each filled its share of the buffer and zeros elsewhere; the last
    to arrive sums the buffers over the node's replicas (and, in a multi-node job, over the
    nodes) in place, so every replica holds every update. Every replica of every node meets
    here exactly once per applied step, so the collectives pair up.

    A stop does not end it: each replica has begun its step (AdamW stepped, Muon's momentum
    moved), and one that left now would be saved half updated, its batches trained again on
    resume. Only `failed` (a worker's error: a replica may never come) or the stall timeout
    ends it early; the run then keeps its newest checkpoint (`Replica.mid_step`)."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        stop_event: threading.Event,
        stall_timeout_s: float,
        nodes: NodeGroup | None = None,
        poll_s: float = 0.05,
        failed: Callable[[], bool] | None = None,
    ) -> None:
        self.buffers, self.nodes = buffers, nodes
        self._meeting = Meeting(
            len(buffers),
            stop_event,
            stall_timeout_s,
            self._sum,
            poll_s,
            "optimizer shares of",
            abort=failed or (lambda: False),
        )

    def exchange(self, rank: int, ready: Mark | None) -> list[Mark]:
        """Meet the other replicas with this one's share written (its lane's mark `ready`);
        returns the marks after the sum, one per replica's device."""
        return self._meeting.meet(rank, ready)

    def _sum(self, ready: list[Mark | None]) -> list[Mark]:
        wait_for([m for m in ready if m is not None])  # every replica's share is written
        sum_into_all(self.buffers)
        if self.nodes is not None:
            first = self.buffers[0]
            self.nodes.sum_device(first)
            for b in self.buffers[1:]:
                b.copy_(first)
        return marks_here([b.device for b in self.buffers])
