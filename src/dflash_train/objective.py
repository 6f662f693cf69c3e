"""The DFlash training objective: anchors, block inputs and labels, the weighted chunked loss.

Facts matched here (see the method notes):
- A position p is a valid anchor iff loss_mask[p] and loss_mask[p + 1]; up to `num_anchors` are
  drawn uniformly without replacement per sequence and sorted.
- A block is [x[p], MASK * (B - 1)]. Offset k (1 .. B - 1) predicts x[p + k]: NO shift. Offset 0
  (the anchor) carries no loss.
- Weight w_k = exp(-(k - 1) / gamma) * loss_mask[p + k] * [p + k inside the sequence].
- Loss = sum(w * CE) / sum(w) over the WHOLE optimizer step (all micro-batches, all drafters):
  this module returns the numerator and the weight sum; the caller divides by the global sum.
- The LM-head cross-entropy runs in row chunks, fused with its gradient (the head is frozen, so
  only d loss / d hidden is needed): memory is one chunk of logits, not anchors x vocabulary, and
  the logits are never recomputed in backward.

Everything that needs the data's values (anchors, labels, which positions carry weight) is
computed on the host by the prefetchers, so the drafter's step has no device-to-host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dflash_train.model.block_attention import BlockLayout

GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}
"""The paper's loss decay constant per block size."""


def default_gamma(block_size: int) -> float:
    """Loss decay constant by block size (7 / 5 / 4 for 16 / 10 / 8); B/2-ish otherwise."""
    return GAMMA_BY_BLOCK_SIZE.get(block_size, max(1.0, (block_size - 1) / 2.0))


def loss_gamma(block_size: int, gamma: float | None = None) -> float:
    """`gamma` when given (the --gamma option), else the paper's default for the block size."""
    return gamma if gamma is not None else default_gamma(block_size)


# ----------------------------------------------------------------------------- anchors (host)
def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p with loss_mask[p] and loss_mask[p + 1] (so offset 1 has a label)."""
    m = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(m[:-1] & m[1:])


def has_valid_anchor(loss_mask: np.ndarray) -> bool:
    """True when a row can train at all: it has at least one valid anchor position."""
    return len(valid_anchor_positions(loss_mask)) > 0


def valid_anchor_counts(loss_mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Valid anchor positions per row of a flat dataset (rows are loss_mask[offsets[i]:
    offsets[i + 1]]), by the rule of `valid_anchor_positions`, without a Python loop."""
    m = np.asarray(loss_mask, dtype=bool)
    pair = np.zeros(len(m), dtype=np.uint8)
    pair[:-1] = m[:-1] & m[1:]
    ends = np.asarray(offsets[1:]) - 1
    pair[ends[ends >= 0]] = 0  # a pair never spans two rows
    starts = np.asarray(offsets[:-1])
    counts = np.zeros(len(starts), dtype=np.int64)
    nonempty = starts < np.asarray(offsets[1:])
    if nonempty.any():
        counts[nonempty] = np.add.reduceat(pair, starts[nonempty], dtype=np.int64)
    return counts


def blocks_per_row(max_anchors: int, num_anchors: int) -> int:
    """Blocks every row of a batch gets: its largest anchor count rounded up to a power of two
    (few distinct shapes), at most `num_anchors`."""
    return min(num_anchors, round_up_pow2(max_anchors))


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `num_anchors` distinct valid anchors drawn uniformly, sorted ascending."""
    pos = valid_anchor_positions(loss_mask)
    if len(pos) > num_anchors:
        pos = np.sort(rng.choice(pos, size=num_anchors, replace=False))
    return pos.astype(np.int64)


def round_up_pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two >= max(n, lo): few distinct anchor counts keep shapes static."""
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def pack_anchors(per_row: list[np.ndarray], num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of anchors -> (batch, num_blocks) anchors and valid flags, padding blocks last."""
    anchors = torch.zeros(len(per_row), num_blocks, dtype=torch.long)
    valid = torch.zeros(len(per_row), num_blocks, dtype=torch.bool)
    for i, a in enumerate(per_row):
        n = min(len(a), num_blocks)
        anchors[i, :n] = torch.from_numpy(np.asarray(a[:n], dtype=np.int64))
        valid[i, :n] = True
    return anchors, valid


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) per-offset weights: 0 for the anchor, exp(-(k - 1) / gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


# ----------------------------------------------------------------------------- batch (host)
@dataclass
class DraftTargets:
    """Labels of the block positions that carry loss (M of them), flattened over the batch.

    select: (M,) flat index into the (batch * N * B) block positions.
    labels: (M,) token ids x[p + k].
    weights: (M,) decay weight times mask.
    offsets: (M,) block offset k of each position (1 .. B - 1), for per-position accuracy.
    """

    select: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor

    def to(self, device: torch.device | str) -> DraftTargets:
        return DraftTargets(
            *(
                t.to(device, non_blocking=True)
                for t in (self.select, self.labels, self.weights, self.offsets)
            )
        )

    def __len__(self) -> int:
        return self.select.numel()

    def split_by_chunks(
        self, num_blocks: int, block_size: int, chunks: list[tuple[int, int, int]]
    ) -> list[DraftTargets]:
        """The targets of each anchor chunk (first block, end block, _), with `select` indexing
        that chunk's own (batch * (end - first) * B) rows. Host tensors in, host tensors out."""
        row_len = num_blocks * block_size
        row, pos = self.select // row_len, self.select % row_len
        block = pos // block_size
        parts = []
        for lo, hi, _ in chunks:
            keep = torch.nonzero((block >= lo) & (block < hi)).squeeze(1)
            select = row[keep] * ((hi - lo) * block_size) + pos[keep] - lo * block_size
            parts.append(
                DraftTargets(select, self.labels[keep], self.weights[keep], self.offsets[keep])
            )
        return parts


def block_token_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """(batch, N * B) block inputs: the anchor token then B - 1 mask tokens per block."""
    batch, n = anchors.shape
    ids = torch.full(
        (batch, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.flatten(1)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float,
) -> DraftTargets:
    """Labels and weights of every block position, keeping only those with weight > 0.

    input_ids, loss_mask: (batch, L) padded (loss_mask is 0 on padding); anchors, valid:
    (batch, N). Runs on the host (it decides shapes).
    """
    _batch, length = input_ids.shape
    offs = torch.arange(block_size)
    pos = anchors[..., None] + offs  # (batch, N, B) positions p + k
    inside = pos < length
    pos_c = pos.clamp(max=length - 1)
    flat_pos = pos_c.flatten(1)
    labels = input_ids.gather(1, flat_pos).view_as(pos)
    mask = loss_mask.gather(1, flat_pos).view_as(pos).bool() & inside & valid[..., None]
    weights = decay_weights(block_size, gamma)[None, None, :] * mask
    flat_w = weights.flatten()
    select = torch.nonzero(flat_w > 0).squeeze(1)
    return DraftTargets(
        select=select,
        labels=labels.flatten()[select],
        weights=flat_w[select].float(),
        offsets=(select % block_size),
    )


# ----------------------------------------------------------------------------- loss (device)
@dataclass
class LossOutput:
    """One micro-batch's contribution. Everything stays on the device (no host sync).

    loss_sum: scalar, sum(w * CE) (differentiable).
    correct: (B,) correct top-1 predictions per block offset (offset 0 always 0).
    count: (B,) supervised positions per block offset.
    """

    loss_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor

    def add_(self, other: LossOutput) -> LossOutput:
        """Accumulate another part of the same micro-batch whose backward has already run."""
        self.loss_sum = self.loss_sum.detach() + other.loss_sum.detach()
        self.correct = self.correct + other.correct
        self.count = self.count + other.count
        return self


class _FusedLinearCE(torch.autograd.Function):
    """sum(w * CE(hidden @ W^T + b, labels)) with d/d hidden computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, w, chunk_rows):
        m = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(m, dtype=torch.bool, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        for lo in range(0, m, chunk_rows):
            hi = min(m, lo + chunk_rows)
            logits = F.linear(hidden[lo:hi], weight, bias).float()  # (C, vocab)
            lse = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, labels[lo:hi, None]).squeeze(1)
            total += (w[lo:hi] * (lse - tgt)).sum()
            correct[lo:hi] = logits.argmax(-1) == labels[lo:hi]
            if need_grad:
                probs = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place of logits
                probs[torch.arange(hi - lo, device=probs.device), labels[lo:hi]] -= 1.0
                probs.mul_(w[lo:hi, None])
                grad[lo:hi] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad,) = ctx.saved_tensors
        g = None if grad is None else grad * grad_total.to(grad.dtype)
        return g, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    w: torch.Tensor,
    chunk_rows: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE summed over rows, and per-row top-1 correctness.

    hidden: (M, H); weight: (V, H) frozen head; labels: (M,); w: (M,) row weights.
    """
    if chunk_rows < 1:
        raise ValueError(f"loss chunk size must be >= 1, got {chunk_rows}")
    return _FusedLinearCE.apply(hidden, weight, bias, labels, w, chunk_rows)


def auto_chunk_rows(vocab_size: int, budget_bytes: int = 64 << 20) -> int:
    """Rows per loss chunk: one chunk of fp32 logits within ~64 MiB, clamped to [512, 4096] rows
    (fewer rows starve a GPU matmul; more only grow memory; on CPU 1K-16K rows measured the same
    speed for a 2K vocabulary)."""
    return int(min(4096, max(512, budget_bytes // (4 * vocab_size))))


def draft_loss(
    hidden: torch.Tensor,
    targets: DraftTargets,
    head_weight: torch.Tensor,
    block_size: int,
    chunk_rows: int,
    head_bias: torch.Tensor | None = None,
) -> LossOutput:
    """Loss numerator and accuracy counts for one micro-batch (the weight sum is known on the
    host: `Job.weight_sum`).

    hidden: (batch, N * B, H) final-normed draft states; targets on the same device.
    """
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.select)
    loss_sum, correct = fused_linear_cross_entropy(
        rows, head_weight, targets.labels, targets.weights, chunk_rows, head_bias
    )
    dev = hidden.device
    count = torch.zeros(block_size, device=dev).index_add_(
        0, targets.offsets, torch.ones_like(targets.weights)
    )
    hits = torch.zeros(block_size, device=dev).index_add_(0, targets.offsets, correct.float())
    return LossOutput(loss_sum, hits, count)


def acceptance_estimate(correct: torch.Tensor, count: torch.Tensor) -> tuple[list[float], float]:
    """Per-offset accuracy acc_k (k = 1 .. B - 1) and the expected acceptance length
    1 + sum_k prod_{i <= k} acc_i (the anchor's bonus token counts 1, as in tau).

    Host sync: call at logging steps only.
    """
    c, n = correct.double().cpu(), count.double().cpu()
    acc = torch.where(n[1:] > 0, c[1:] / n[1:].clamp(min=1), torch.zeros_like(n[1:]))
    return acc.tolist(), float(1.0 + torch.cumprod(acc, 0).sum())


def make_layout(
    anchors: torch.Tensor, valid: torch.Tensor, block_size: int, device, num_chunks: int = 8
) -> BlockLayout:
    """The attention layout of a batch (thin alias so callers need only this module)."""
    return BlockLayout.build(anchors, valid, block_size, device, num_chunks)
