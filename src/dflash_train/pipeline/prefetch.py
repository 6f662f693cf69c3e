"""Prefetchers: planned batches -> padded, anchored jobs on the shared job queue.

Host work only (numpy / CPU torch): reading rows from the memory-mapped dataset, right-padding to
the bucket length, sampling anchors, building block inputs, labels and weights, and the blockwise
attention's chunk plan. Anchors are drawn from a generator seeded by (seed, epoch, sequence id),
so they do not depend on which thread built the batch or in what order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dflash_train import faults
from dflash_train.data.buckets import Batching, BatchSpec, assign_buckets, batch_counts, plan_epoch
from dflash_train.data.dataset import PreparedDataset
from dflash_train.model.block_attention import BlockLayout
from dflash_train.objective import (
    block_targets,
    block_token_ids,
    blocks_per_row,
    pack_anchors,
    sample_anchors,
)
from dflash_train.pipeline.records import Job
from dflash_train.pipeline.stages import BatchPlan, Channels, JobBuilder
from dflash_train.position_weights import loss_normaliser


class EpochPlans:
    """The batch plan of every epoch, computed once and shared by all prefetchers.

    With `done` (an (epochs, rows) boolean array: the ids a resumed run already trained),
    `iter_all` leaves out every planned batch whose ids are all done; the others come in their
    planned order and composition, so a resumed run trains exactly the rest of each epoch.
    With `shard` = (node, nodes), `iter_all` yields only this node's share of every epoch: of
    each bucket's batches, in epoch order, the j-th for j = node modulo nodes, so the nodes'
    shares are disjoint and together the whole epoch (every node plans the same epochs from the
    same seed), and each node's share follows the bucket shares as the epoch's order does
    (dealing by position instead would give a node a random sample of the interleaved order).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        bucket_lengths: list[int],
        batching: Batching,
        seed: int,
        epochs: int,
        done: np.ndarray | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        if done is not None and done.shape != (epochs, len(lengths)):
            raise ValueError(
                f"resume state covers {done.shape} (epochs, rows), the plan "
                f"{(epochs, len(lengths))}: not the same data or epochs"
            )
        self.done = done
        self.node, self.nodes = shard
        self.bucket_lengths = list(bucket_lengths)
        self.num_rows = len(lengths)
        self.bucket_of = assign_buckets(lengths, self.bucket_lengths)
        self.batching = batching
        self.seed, self.epochs = seed, epochs
        self._cache: dict[int, list[BatchSpec]] = {}
        self._lock = threading.Lock()

    def epoch(self, e: int) -> list[BatchSpec]:
        with self._lock:
            if e not in self._cache:
                self._cache[e] = plan_epoch(
                    self.bucket_of, self.bucket_lengths, self.batching, self.seed, e
                )
                self._cache.pop(e - 2, None)  # prefetchers are never two epochs apart
            return self._cache[e]

    def batches_per_epoch(self) -> int:
        return len(self.epoch(0))

    def iter_all(self) -> Iterator[BatchSpec]:
        """This node's stream: its share of every epoch's batches in plan order, less those a
        resumed run already trained."""
        for node, spec in self._dealt():
            if node == self.node:
                yield spec

    def stream_lengths(self) -> list[int]:
        """Batches in every node's stream (`iter_all` on each node): the nodes train in
        lockstep, so the longest one sets how many steps the data needs. An epoch none of
        whose rows was trained yet is counted without planning it (`batch_counts`: the same
        batches per bucket in every epoch, each bucket's dealt to the nodes in turn)."""
        counts = [0] * self.nodes
        per_bucket: list[int] | None = None
        for e in range(self.epochs):
            if self.done is not None and self.done[e].any():
                for node, _ in self._dealt_epoch(e):  # partly trained: count what is left
                    counts[node] += 1
                continue
            if per_bucket is None:
                per_bucket = batch_counts(self.bucket_of, self.bucket_lengths, self.batching)
            for node in range(self.nodes):
                counts[node] += sum(n // self.nodes + (node < n % self.nodes) for n in per_bucket)
        return counts

    def _dealt(self) -> Iterator[tuple[int, BatchSpec]]:
        """(node, spec) of every batch still to train, in plan order."""
        for e in range(self.epochs):
            yield from self._dealt_epoch(e)

    def _dealt_epoch(self, e: int) -> Iterator[tuple[int, BatchSpec]]:
        """(node, spec) of epoch `e`'s batches still to train, in plan order: each bucket's
        batches dealt to the nodes in turn."""
        if self.done is not None and self.done[e].all():
            return  # a finished epoch of a resumed run: no need to plan it
        seen = [0] * len(self.bucket_lengths)  # batches of each bucket so far this epoch
        for spec in self.epoch(e):
            rank, seen[spec.bucket] = seen[spec.bucket], seen[spec.bucket] + 1
            if not self._is_done(spec):
                yield rank % self.nodes, spec

    def _is_done(self, spec: BatchSpec) -> bool:
        if self.done is None:
            return False
        done = self.done[spec.epoch][list(spec.seq_ids)]
        if done.any() and not done.all():
            # A committed step trains whole batches: a half-trained batch means another plan.
            raise ValueError(
                f"epoch {spec.epoch} batch {spec.index} is partly trained in the resume state: "
                "the data, batching or seed differ from the checkpointed run"
            )
        return bool(done.all())


@dataclass
class BatchBuilder:
    """Turns a `BatchSpec` into a `Job` (everything the target and drafter need, on the host)."""

    dataset: PreparedDataset
    bucket_lengths: list[int]
    block_size: int
    num_anchors: int
    gamma: float
    mask_token_id: int
    seed: int
    attention_chunks: int = 8
    pad_token_id: int = 0
    position_weights: str = "decay"

    def build(self, spec: BatchSpec) -> Job:
        t0 = time.perf_counter()
        job = self.from_rows(spec, [self.dataset.row(sid) for sid in spec.seq_ids])
        job.prefetch_s = time.perf_counter() - t0
        return job

    def from_rows(
        self,
        spec: BatchSpec,
        rows: list[tuple[np.ndarray, np.ndarray]],
        length: int | None = None,
    ) -> Job:
        """A job of `spec`'s bucket from in-memory (input_ids, loss_mask) rows, padded to the
        bucket's length (or to `length`)."""
        return make_job(
            spec,
            rows,
            length or self.bucket_lengths[spec.bucket],
            block_size=self.block_size,
            num_anchors=self.num_anchors,
            gamma=self.gamma,
            mask_token_id=self.mask_token_id,
            seed=self.seed,
            attention_chunks=self.attention_chunks,
            pad_token_id=self.pad_token_id,
            position_weights=self.position_weights,
        )


def make_job(
    spec: BatchSpec,
    rows: list[tuple[np.ndarray, np.ndarray]],
    length: int,
    *,
    block_size: int,
    num_anchors: int,
    gamma: float,
    mask_token_id: int,
    seed: int,
    attention_chunks: int = 8,
    pad_token_id: int = 0,
    position_weights: str = "decay",
) -> Job:
    """A job from in-memory rows of (input_ids, loss_mask), right-padded to `length`.

    Anchors of row i come from a generator seeded by (seed, epoch, sequence id); the number of
    blocks is the largest row's anchor count rounded up to a power of two (few shapes). Its
    `weight_sum` is the batch's share of the loss divisor for `position_weights`.
    """
    n_rows = len(rows)
    ids = np.full((n_rows, length), pad_token_id, dtype=np.int64)
    mask = np.zeros((n_rows, length), dtype=np.uint8)
    anchors_per_row = []
    real = 0
    for r, ((row_ids, row_mask), sid) in enumerate(zip(rows, spec.seq_ids, strict=True)):
        n = len(row_ids)
        ids[r, :n] = row_ids
        mask[r, :n] = row_mask
        real += n
        rng = np.random.default_rng([seed, spec.epoch, sid])
        anchors_per_row.append(sample_anchors(row_mask, num_anchors, rng))
    most = max((len(a) for a in anchors_per_row), default=0)
    num_blocks = blocks_per_row(most, num_anchors)
    anchors, valid = pack_anchors(anchors_per_row, num_blocks)
    input_ids = torch.from_numpy(ids)
    targets = block_targets(input_ids, torch.from_numpy(mask), anchors, valid, block_size, gamma)
    layout = BlockLayout.build(anchors, valid, block_size, None, attention_chunks)
    return Job(
        epoch=spec.epoch,
        index=spec.index,
        bucket=spec.bucket,
        seq_ids=np.asarray(spec.seq_ids, dtype=np.int64),
        input_ids=input_ids,
        block_ids=block_token_ids(input_ids, anchors, block_size, mask_token_id),
        layout=layout,
        targets=targets,
        weight_sum=loss_normaliser(targets.weights, valid, position_weights),
        num_tokens=real,
        num_padded=n_rows * length - real,
        prefetch_s=0.0,
        chunk_targets=targets.split_by_chunks(num_blocks, block_size, layout.chunks),
        loss_mask=mask,
    )


@dataclass
class PrefetchTask:
    """Prefetcher `rank` of `world` builds every `world`-th planned batch, starting at `rank`."""

    rank: int
    world: int
    plans: BatchPlan
    builder: JobBuilder
    pin: bool = False
    """Pin each job's host tensors (`Job.pinned`): a CUDA device copies them."""
    limit: int | None = None
    """Stream positions the schedule can train (None: the whole stream): batches past it would
    only take the targets' time from the batches that are trained."""


def run_prefetcher(task: PrefetchTask, ch: Channels) -> None:
    """Build this prefetcher's share of the plan onto the job queue; the caller signals done.
    A job's stream position (`Job.seq`) is its batch's place in `iter_all()`, so the queues can
    restore the planned order whichever prefetcher finishes first."""
    for i, spec in enumerate(task.plans.iter_all()):
        if ch.stop.is_set() or (task.limit is not None and i >= task.limit):
            return
        if i % task.world != task.rank:
            continue
        faults.point("prefetch")
        job = task.builder.build(spec)
        job.seq = i
        if task.pin:
            job = job.pinned()
        ch.timers.add("prefetch_s", job.prefetch_s)
        ch.accounting.add("read", spec.epoch, spec.seq_ids)
        ch.jobs.put(job, bucket=spec.bucket, seq=i)
