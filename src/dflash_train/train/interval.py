"""Metrics of one logging interval: aggregated on the main thread, host syncs only here.

Rank 0's drafter hands every applied step's `StepOutcome` (device tensors + host counts) to the
main thread; this accumulates them and, at a log step, turns them into one flat dict of
namespaced numbers (train/, time/, queue/).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.devices import Mark, wait_for
from dflash_train.objective import acceptance_estimate, selector_estimates
from dflash_train.pipeline.mixing import random_pull_tv
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.queue import BufferedHSQueue, QueueStats, total_variation
from dflash_train.pipeline.sync import StepOutcome


@dataclass
class IntervalMetrics:
    """Accumulates steps between two log lines."""

    bucket_weights: dict[int, float]
    num_target_workers: int
    num_drafters: int
    steps: int = 0
    weight: float = 0.0
    loss_sum: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    count: torch.Tensor | None = None
    selector: torch.Tensor | None = None
    pos_weight: torch.Tensor | None = None
    rounds: np.ndarray | None = None
    """On-policy: (rounds, tokens they emitted, rejected drafts) of the interval."""
    rejected: torch.Tensor | None = None
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    padded: int = 0
    supervised: int = 0
    seqs: int = 0
    drawn: dict[int, int] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    _last_timers: dict[str, float] | None = None
    _last_counts: dict[str, int] | None = None
    _last_queue: QueueStats | None = None
    _held: list = field(default_factory=list)

    def add(
        self, outcome: StepOutcome, grad_norm: torch.Tensor | None, ready: Sequence[Mark] = ()
    ) -> None:
        """One step's outcome. Its device tensors were written on rank 0's lane (or the
        reducer's): this thread's stream waits for `ready` (no host wait) before the sums below
        read them, and the tensors are held until the flush has read the sums, so their memory
        cannot be reused by the lane that freed them before this thread's reads ran."""
        wait_for(list(ready))
        self._held.append((outcome, grad_norm))
        self.steps += 1
        self.weight += outcome.global_weight
        if outcome.loss_sum is not None:
            self.loss_sum = _acc(self.loss_sum, outcome.loss_sum)
            self.correct = _acc(self.correct, outcome.correct)
            self.count = _acc(self.count, outcome.count)
            if outcome.selector is not None:
                self.selector = _acc(self.selector, outcome.selector)
            if outcome.pos_weight is not None:
                self.pos_weight = _acc(self.pos_weight, outcome.pos_weight)
        if outcome.rounds is not None:
            counts = np.asarray(outcome.rounds, dtype=np.int64)
            self.rounds = counts if self.rounds is None else self.rounds + counts
            if outcome.rejected is not None:
                self.rejected = _acc(self.rejected, outcome.rejected)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        for job in outcome.jobs:
            self.tokens += job.num_tokens
            self.padded += job.num_padded
            self.supervised += job.num_supervised
            self.seqs += len(job.seq_ids)
            self.drawn[job.bucket] = self.drawn.get(job.bucket, 0) + 1

    def flush(
        self,
        timers: StageTimers,
        hs_queue: BufferedHSQueue,
        lr: float,
        across_nodes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> dict[str, float]:
        """The interval's metrics; resets the accumulators (host syncs happen here).

        `across_nodes` (a multi-node job) sums a vector over the nodes: throughput counters and
        drawn buckets become the job's, queue health the mean over the nodes; the loss
        statistics already are the job's (the step reduced them).
        """
        now = time.monotonic()
        dt = max(1e-9, now - self.t0)
        queue = self._queue(hs_queue, dt)
        queue.update(self._ages(hs_queue))  # this node's draws: before the sum over nodes
        if across_nodes is not None:
            queue = self._sum_over_nodes(queue, across_nodes)
        out: dict[str, float] = {"train/lr": lr}
        if self.weight > 0 and self.loss_sum is not None:
            out["train/loss"] = float(self.loss_sum) / self.weight  # host sync (log step)
            acc, tau = acceptance_estimate(self.correct, self.count)
            out.update({f"train/acc_k{k + 1}": a for k, a in enumerate(acc)})
            out["train/tau_est"] = tau
            if self.pos_weight is not None:
                out.update(_mean_per_offset("train/pos_weight_k", self.pos_weight, self.count))
            if self.selector is not None:
                out.update(self._selector_metrics(tau))
            if self.rounds is not None:
                out.update(self._round_metrics(shares=across_nodes is None))
        if self.grad_norms:
            out["train/grad_norm"] = float(
                torch.stack([g.to(self.grad_norms[0].device) for g in self.grad_norms]).mean()
            )
        out["train/tokens_per_s"] = self.tokens / dt
        out["train/supervised_per_s"] = self.supervised / dt
        out["train/seqs_per_s"] = self.seqs / dt
        total = self.tokens + self.padded
        out["train/padding_frac"] = self.padded / total if total else 0.0
        out.update(self._stage_times(timers))
        out.update(queue)
        if self.drawn:
            out["queue/mix_tv"] = total_variation(
                {b: float(n) for b, n in self.drawn.items()}, self.bucket_weights
            )
            # What a random pull of as many batches would give: the baseline to read it by.
            draws = sum(self.drawn.values())
            out["queue/mix_tv_random"] = random_pull_tv(self.bucket_weights, draws)
        self._reset(now)
        return out

    def _round_metrics(self, shares: bool = True) -> dict[str, float]:
        """On-policy anchors (this node's rounds): train/opd_tau, the mean tokens a verify round
        of the current drafter emitted on the training rows (accepted drafts + the correction,
        as tau counts them: an exact greedy estimate, free, per round rather than per
        response), rejected drafts per row, and with `shares` (one node: the rejected sum is
        this node's, train/loss the job's) the two streams' shares of train/loss."""
        assert self.rounds is not None and self.loss_sum is not None
        rounds, emitted, rejected = (int(x) for x in self.rounds)
        out = {
            "train/opd_tau": emitted / rounds if rounds else 0.0,
            "train/opd_rejected_per_row": rejected / self.seqs if self.seqs else 0.0,
        }
        if not shares:
            return out
        rej = float(self.rejected.sum()) if self.rejected is not None else 0.0  # host sync
        out["train/opd_rejected_loss"] = rej / self.weight
        out["train/opd_response_loss"] = (float(self.loss_sum) - rej) / self.weight
        return out

    def _ages(self, q: BufferedHSQueue) -> dict[str, float]:
        """How long the batches drawn since the last log line waited in this node's queue, in
        optimizer steps (its batches taken while each waited / this interval's batches per
        step): a batch planned long ago trains on a stale mix, and a run stopped at
        --max-steps would leave the oldest untrained."""
        ages = q.take_ages()
        draws = sum(self.drawn.values())
        if not ages or not draws or not self.steps:
            # The same keys on every node (their values are averaged over the nodes).
            return {"queue/age_steps_mean": 0.0, "queue/age_steps_max": 0.0}
        per_step = draws / self.steps  # this node's batches per step (drafters x grad_accum)
        return {
            "queue/age_steps_mean": float(np.mean(ages)) / per_step,
            "queue/age_steps_max": float(max(ages)) / per_step,
        }

    def _selector_metrics(self, unary_tau: float) -> dict[str, float]:
        """DFlash 2: the drafts served come from the selector's path, so train/tau_est is its
        estimate; the unary logits' own goes to train/tau_est_unary (host sync: log step)."""
        recall, acc, tau, sel_sum = selector_estimates(self.selector, self.count)
        out = {f"train/topk_recall_k{k + 1}": r for k, r in enumerate(recall)}
        out.update({f"train/selector_acc_k{k + 1}": a for k, a in enumerate(acc)})
        out["train/tau_est"], out["train/tau_est_unary"] = tau, unary_tau
        out["train/selector_loss"] = sel_sum / self.weight
        out.update(_mean_per_offset("train/selector_pos_weight_k", self.selector[3], self.count))
        return out

    def _sum_over_nodes(
        self, queue: dict[str, float], across_nodes: Callable[[np.ndarray], np.ndarray]
    ) -> dict[str, float]:
        buckets = sorted(self.bucket_weights)
        health = sorted(queue)
        vec = np.array(
            [1.0, self.tokens, self.padded, self.supervised, self.seqs]
            + [float(self.drawn.get(b, 0)) for b in buckets]
            + [queue[k] for k in health]
        )
        vec = across_nodes(vec)
        nodes, rest = vec[0], vec[5:]
        self.tokens, self.padded, self.supervised, self.seqs = (int(x) for x in vec[1:5])
        self.drawn = {b: int(n) for b, n in zip(buckets, rest[: len(buckets)], strict=True) if n}
        return {k: v / nodes for k, v in zip(health, rest[len(buckets) :], strict=True)}

    def _stage_times(self, timers: StageTimers) -> dict[str, float]:
        seconds, counts = timers.snapshot()
        last_s = self._last_timers or {}
        last_c = self._last_counts or {}
        self._last_timers, self._last_counts = seconds, counts
        out = {}
        for stage, total in counts.items():
            n = total - last_c.get(stage, 0)
            if n:
                out[f"time/{stage}"] = (seconds[stage] - last_s.get(stage, 0.0)) / n
        return out

    def _queue(self, q: BufferedHSQueue, dt: float) -> dict[str, float]:
        s = q.stats()
        last = self._last_queue
        self._last_queue = s
        blocked = s.producer_blocked_s - (last.producer_blocked_s if last else 0.0)
        starved = s.consumer_starved_s - (last.consumer_starved_s if last else 0.0)
        # The plan order's price: drafters waiting for their planned batch while others wait
        # in the buffer (0 with an arrival-order pull).
        hol = s.consumer_hol_s - (last.consumer_hol_s if last else 0.0)
        out = {
            "queue/depth": float(s.depth),
            "queue/bytes": float(s.bytes),
            "queue/put_total": float(s.put_total),
            "queue/get_total": float(s.got_total),
            "queue/producer_blocked_frac": min(1.0, blocked / (dt * self.num_target_workers)),
            "queue/consumer_starved_frac": min(1.0, starved / (dt * self.num_drafters)),
            "queue/hol_wait_frac": min(1.0, hol / (dt * self.num_drafters)),
        }
        for b in self.bucket_weights:
            out[f"queue/bucket{b}_depth"] = float(s.bucket_depth.get(b, 0))
        return out

    def _reset(self, now: float) -> None:
        self.steps, self.weight = 0, 0.0
        self.loss_sum = self.correct = self.count = self.selector = self.pos_weight = None
        self.rounds = self.rejected = None
        self.grad_norms = []
        self._held = []  # the flush's host syncs have read them
        self.tokens = self.padded = self.supervised = self.seqs = 0
        self.drawn = {}
        self.t0 = now


def _mean_per_offset(prefix: str, sums: torch.Tensor, count: torch.Tensor) -> dict[str, float]:
    """Per block offset k = 1 .. B - 1 the mean of a (B,) sum over its supervised positions:
    where the gradient goes (host sync: log steps only)."""
    mean = sums.double().cpu()[1:] / count.double().cpu()[1:].clamp(min=1)
    return {f"{prefix}{k + 1}": float(v) for k, v in enumerate(mean)}


def _acc(total: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x.clone() if total is None else total + x.to(total.device)
