"""Typed records that travel through the pipeline's queues."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_train.devices import Mark
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

    @property
    def num_supervised(self) -> int:
        return int(self.targets.select.numel())


@dataclass
class HSBatch:
    """A job with the target's features of its selected layers.

    features: (batch, L, K * hidden) on the target device, possibly still being computed on the
    target worker's lane; `ready` marks the end of those kernels (None: the consumer's own
    thread produced it). A drafter copies it with `devices.handover(features, device, ready)`,
    which orders the copy after them.
    """

    job: Job
    features: torch.Tensor
    ready: Mark | None = None

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size()
