"""Position weights of the block loss: the paper's fixed decay or D-PACE, and the divisor each
implies (a host number per batch).

D-PACE ("Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting", arXiv
2605.18810): per block and offset j = 1 .. B - 1 the drafter's confidence in the gold token
q_j = exp(-CE_j), detached; smoothed q~_j = (1 - alpha) q_j + alpha; weight
w_j = sum_{m >= j} prod_{i <= m} q~_i, the credit of position j towards the expected accepted
length; loss sum_j w_j CE_j. How this project ends the product and normalises is said below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POSITION_WEIGHTS = ("decay", "dpace")


@dataclass(frozen=True)
class PositionWeights:
    """How the loss weighs block positions: the paper's fixed decay (the host's weights, divided
    by their sum) or D-PACE (weights from the drafter's detached confidences, divided by the
    number of valid anchors).

    alpha: D-PACE's smoothing, q~ = (1 - alpha) q + alpha, in (0, 1].
    """

    kind: str = "decay"
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in POSITION_WEIGHTS:
            raise ValueError(f"position weights must be one of {POSITION_WEIGHTS}: {self.kind!r}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.alpha}")

    @property
    def dynamic(self) -> bool:
        """Whether the weights depend on the drafter (computed on the device per batch)."""
        return self.kind == "dpace"


DECAY = PositionWeights()
"""The paper's fixed decay (the default)."""


def loss_normaliser(weights: torch.Tensor, valid: torch.Tensor, kind: str = "decay") -> float:
    """A batch's share of the step's loss divisor, a host number (summed over every micro-batch,
    replica and node before anyone divides, so the update does not depend on how rows are split).

    decay: the sum of its position weights (the paper's sum(w)). dpace: its valid anchors, so
    the loss is the mean over the step's blocks of sum_j w_j CE_j: dividing by sum(w) instead
    would cancel the credit mass D-PACE's weights carry (the paper author's point in SpecForge
    issue 828), and a per-anchor mean keeps the decay's balance between sequences (each block
    counts once), so the two objectives differ only in their weights.
    """
    if kind == "dpace":
        return float(valid.sum())
    return float(weights.sum())


def dpace_weights(
    confidence: torch.Tensor,
    select: torch.Tensor,
    num_blocks: int,
    block_size: int,
    alpha: float,
) -> torch.Tensor:
    """D-PACE's weight of every supervised row: w_j = sum_{m >= j} prod_{i <= m} q~_i over the
    block's offsets i = 1 .. B - 1, with q~ = (1 - alpha) q + alpha. w_j is d E[L] / d log q_j
    for E[L] = sum_m prod_{i <= m} q~_i, the (smoothed) expected accepted length of the block.

    confidence: (M,) the drafter's probability of the gold token per row (detached here);
    select: (M,) the rows' flat indices into the (num_blocks * B) block positions. A position
    that is not a row (unsupervised, past the end of the sequence, or a padding block) has
    q~ = 0: it ends the product, as acceptance ends there (nothing later is drafted for it).
    """
    with torch.no_grad():
        smoothed = (1.0 - alpha) * confidence.detach().float() + alpha  # (M,)
        grid = torch.zeros(num_blocks * block_size, device=smoothed.device)
        grid[select] = smoothed
        grid = grid.view(num_blocks, block_size)
        grid[:, 0] = 1.0  # the anchor is given, never drafted
        prefix = torch.cumprod(grid, dim=1)  # (blocks, B): prod_{i <= m} q~_i
        credit = prefix.flip(1).cumsum(1).flip(1)  # (blocks, B): sum over m >= j
        return credit.flatten()[select]
