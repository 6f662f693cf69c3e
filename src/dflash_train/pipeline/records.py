"""Typed records that travel through the pipeline's queues."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.devices import HostStaged, Mark
from dflash_train.model.block_attention import BlockLayout
from dflash_train.objective import DraftTargets


@dataclass
class Job:
    """A padded batch ready for the target (built by a prefetcher, on the host).

    input_ids: (batch, L) int64, right-padded to the bucket length L.
    block_ids: (batch, N * B) int64, [anchor token, MASK * (B - 1)] per block.
    layout: where blocks start (host tensors + the blockwise chunk plan).
    targets: labels and weights of the supervised block positions.
    weight_sum: the batch's share of the loss divisor (`position_weights.loss_normaliser`: the
        sum of targets.weights, or with D-PACE its valid anchors), known on the host so the
        drafters' global loss normalisation needs no device sync.
    chunk_targets: `targets` split by the layout's anchor chunks (the chunked step's), on the
        host; empty: split when needed.
    loss_mask: (batch, L) host uint8, the rows' responses: with on-policy anchors the drafter
        replaces the anchors, targets and weight_sum by its own rounds' (None: not needed).
    """

    epoch: int
    index: int
    bucket: int
    seq_ids: np.ndarray
    input_ids: torch.Tensor
    block_ids: torch.Tensor
    layout: BlockLayout
    targets: DraftTargets
    weight_sum: float
    num_tokens: int
    num_padded: int
    prefetch_s: float
    chunk_targets: list[DraftTargets] = field(default_factory=list)
    loss_mask: np.ndarray | None = None
    seq: int = -1
    """Its position in this node's stream of planned batches (0, 1, 2, ...): the queues
    release jobs and batches in this order (`mix` "plan"); -1 outside a planned stream."""

    @property
    def num_supervised(self) -> int:
        return int(self.targets.select.numel())

    def pinned(self) -> Job:
        """The same job with every host tensor in pinned (page-locked) memory, so the
        devices' copies of them are asynchronous (`to(device, non_blocking=True)`; from
        pageable memory a copy is staged by the host first). The prefetchers pin when a CUDA
        device takes part, off the drafters' and targets' threads. Needs CUDA."""
        layout = self.layout
        layout = dataclasses.replace(
            layout,
            anchors=layout.anchors.pin_memory(),
            valid=layout.valid.pin_memory(),
            context_limits=layout.context_limits.pin_memory(),
        )
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.pin_memory(),
            block_ids=self.block_ids.pin_memory(),
            layout=layout,
            targets=_pinned_targets(self.targets),
            chunk_targets=[_pinned_targets(t) for t in self.chunk_targets],
        )


def _pinned_targets(targets: DraftTargets) -> DraftTargets:
    return DraftTargets(
        **{f.name: getattr(targets, f.name).pin_memory() for f in dataclasses.fields(targets)}
    )


@dataclass
class HSBatch:
    """A job with the target's features of its selected layers.

    features: (batch, L, K * hidden) on the target device, possibly still being computed on the
    target worker's lane; `ready` marks the end of those kernels (None: the consumer's own
    thread produced it). A drafter copies it with `devices.handover(features, device, ready)`,
    which orders the copy after them. From a feature store read for a CUDA drafter: the rows'
    stored bytes in pinned host memory (`HostStaged`), decoded by the drafter on its device.
    """

    job: Job
    features: torch.Tensor | HostStaged
    ready: Mark | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the features hold where they wait (what `--hs-queue-bytes` counts)."""
        return self.features.nbytes
