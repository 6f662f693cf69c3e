"""The DFlash training objective: anchors, block inputs and labels, the weighted chunked loss.

Facts matched here (see the method notes):
- A position p is a valid anchor iff loss_mask[p] and loss_mask[p + 1]; up to `num_anchors` are
  drawn uniformly without replacement per sequence and sorted.
- A block is [x[p], MASK * (B - 1)]. Offset k (1 .. B - 1) predicts x[p + k]: NO shift. Offset 0
  (the anchor) carries no loss.
- Weight w_k = exp(-(k - 1) / gamma) * loss_mask[p + 1] * ... * loss_mask[p + k] * [p + k
  inside the sequence]: the paper multiplies by loss_mask[p + k] alone; the product ends a block
  with its answer, where a multi-turn row's next answer would start inside it.
- Loss = sum(w * CE) / sum(w) over the WHOLE optimizer step (all micro-batches, all drafters):
  this module returns the numerator and the weight sum; the caller divides by the global sum.
- D-PACE (`--position-weights dpace`, arXiv 2605.18810) replaces the decay by weights from the
  drafter's own detached confidences (`dpace_weights`) and the divisor by the step's number of
  valid anchors (`loss_normaliser`): still a host number, so still exact across chunks,
  micro-batches, replicas and nodes.
- The LM-head loss runs in row chunks, fused with its gradient (`head_loss`; the head is frozen,
  so only d loss / d hidden is needed): memory is one chunk of logits, not anchors x vocabulary,
  and the logits are never recomputed in backward. The loss is the paper's cross-entropy on the
  data's tokens or one on the target's own distribution (`--loss`: KL, LK), whose teacher for
  x[p + k] is the target at p + k - 1 (`DraftTargets.teacher_rows`).

- DFlash 2 adds alpha x a K-way cross-entropy of the candidate path selector's scores over the
  top-K unary candidates (`SelectorLoss`), teacher-forced with the previous gold token and the
  same position weights; the top K of each row is taken chunk by chunk inside the same fused
  loss, so the full-vocabulary logits still exist for one chunk at a time.

Everything that needs the data's values (anchors, labels, which positions carry weight) is
computed on the host by the prefetchers, so the drafter's step has no device-to-host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dflash_train.head_loss import (  # noqa: F401 (re-exported: the objective's loss pieces)
    CE,
    HeadLoss,
    Teacher,
    auto_chunk_rows,
    fused_head_loss,
    fused_linear_cross_entropy,
    loss_chunk_bytes,
)
from dflash_train.model.block_attention import BlockLayout
from dflash_train.model.dflash2 import CandidateSelector
from dflash_train.opd_loss import rejected_k3
from dflash_train.position_weights import DECAY, PositionWeights, dpace_weights

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
    weights: (M,) decay weight times mask (with D-PACE the device replaces them; the host keeps
        the decay's, which `--selector-weights uniform` and the row selection read).
    offsets: (M,) block offset k of each position (1 .. B - 1), for per-position accuracy.
    predecessors: (M,) token ids x[p + k - 1] (the anchor for k = 1): DFlash 2's selector is
        teacher-forced with the previous gold token.
    teacher_rows: (M,) flat index into the batch's (batch * L) token positions of p + k - 1,
        where the target's own next-token distribution for x[p + k] is (the teacher's row for
        the losses on the target's distribution; the token there is `predecessors`).
    """

    select: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    predecessors: torch.Tensor
    teacher_rows: torch.Tensor

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (
            self.select,
            self.labels,
            self.weights,
            self.offsets,
            self.predecessors,
            self.teacher_rows,
        )

    def to(self, device: torch.device | str) -> DraftTargets:
        return DraftTargets(*(t.to(device, non_blocking=True) for t in self._fields()))

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
            parts.append(DraftTargets(select, *(t[keep] for t in self._fields()[1:])))
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
    supervised: torch.Tensor | None = None,
) -> DraftTargets:
    """Labels and weights of every block position, keeping only those with weight > 0.

    input_ids, loss_mask: (batch, L) padded (loss_mask is 0 on padding); anchors, valid:
    (batch, N). supervised: (batch, N) the last offset each block supervises (on-policy
    rounds: accepted + 1, the correction; later offsets were never verified); None: every one.
    Runs on the host (it decides shapes).
    """
    batch, length = input_ids.shape
    offs = torch.arange(block_size)
    pos = anchors[..., None] + offs  # (batch, N, B) positions p + k
    inside = pos < length
    pos_c = pos.clamp(max=length - 1)
    flat_pos = pos_c.flatten(1)
    labels = input_ids.gather(1, flat_pos).view_as(pos)
    mask = loss_mask.gather(1, flat_pos).view_as(pos).bool() & inside
    # A block ends with its answer: served, the draft stops at the end of the turn, so no
    # position after an unsupervised one is the drafter's, even where a later answer of a
    # multi-turn row starts again within the block (after a short user turn).
    mask[..., 1:] = mask[..., 1:].cummin(dim=-1).values
    mask &= valid[..., None]
    if supervised is not None:
        mask &= offs <= supervised[..., None]
    weights = decay_weights(block_size, gamma)[None, None, :] * mask
    flat_w = weights.flatten()
    select = torch.nonzero(flat_w > 0).squeeze(1)
    # x[p + k - 1]: the label of the offset before (the anchor x[p] for k = 1); never past the
    # end for a supervised k, since p + k is inside the sequence.
    previous = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1)
    # The teacher of x[p + k] is the target at p + k - 1 (>= p: never before the anchor).
    shifted = torch.arange(batch)[:, None, None] * length + pos_c - 1
    return DraftTargets(
        select=select,
        labels=labels.flatten()[select],
        weights=flat_w[select].float(),
        offsets=(select % block_size),
        predecessors=previous.flatten()[select],
        teacher_rows=shifted.flatten()[select],
    )


# ----------------------------------------------------------------------------- loss (device)
@dataclass
class LossOutput:
    """One micro-batch's contribution. Everything stays on the device (no host sync).

    loss_sum: scalar, sum(w * CE) (+ alpha * the selector's sum for DFlash 2; differentiable).
    correct: (B,) correct top-1 predictions of the unary logits per block offset (offset 0
        always 0).
    count: (B,) supervised positions per block offset.
    selector: DFlash 2 only, (4, B) per block offset: gold tokens among the top-K unary
        candidates, correct teacher-forced selector picks, sum(w * selector CE) (unscaled) and
        the sum of the selector term's position weights.
    pos_weight: (B,) the sum of the unary term's position weights per block offset (divided
        by `count`: where the gradient goes; None only in tests that fake a loss).
    rejected: on-policy only, (1,) the rejected-draft stream's weighted sum (inside loss_sum).
    normaliser: on-policy only, a HOST number: the micro-batch's share of the step's loss
        divisor, known only once the replica computed its rounds (None: the job's
        `weight_sum`, set by the prefetcher).
    rounds: on-policy only, host counts (rounds, tokens they emitted, rejected drafts).
    """

    loss_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    selector: torch.Tensor | None = None
    pos_weight: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    normaliser: float | None = None
    rounds: tuple[int, int, int] | None = None

    def add_(self, other: LossOutput) -> LossOutput:
        """Accumulate another part of the same micro-batch whose backward has already run."""
        self.loss_sum = self.loss_sum.detach() + other.loss_sum.detach()
        self.correct = self.correct + other.correct
        self.count = self.count + other.count
        if self.selector is not None:
            self.selector = self.selector + other.selector
        if self.pos_weight is not None:
            self.pos_weight = self.pos_weight + other.pos_weight
        if other.rejected is not None:
            mine = self.rejected
            self.rejected = other.rejected if mine is None else mine + other.rejected
        return self


SELECTOR_STAT_ROWS = 4
"""Rows of `LossOutput.selector`: top-K hits, selector hits, selector CE sum, weight sum."""


SELECTOR_MISSES = ("exclude", "inject")
SELECTOR_WEIGHTS = ("decayed", "uniform")


def uniform_position_weight(block_size: int, gamma: float) -> float:
    """The mean of the decayed weights over a block's predicted offsets 1 .. B-1: the uniform
    weight that keeps a full block's total weight."""
    return float(decay_weights(block_size, gamma)[1:].mean())


@dataclass
class SelectorLoss:
    """DFlash 2's selector term: alpha x the K-way cross-entropy of the selector's scores over
    the top-K unary candidates, teacher-forced (the predecessor is the previous gold token), with
    the unary term's kind of position weights.

    misses: a gold token outside the top K is left out of the term ("exclude") or replaces the
        weakest candidate, for the loss only ("inject"; accuracy never counts it).
    backbone_grad: whether the term's gradient reaches the drafter's states (and through them
        the backbone); off, it trains the selector's own parameters only.
    uniform_weight: None: the run's position weights (the decay, or D-PACE from the selector's
        own confidences); a number: every supervised position weighs this much instead
        (`uniform_position_weight`: the decayed weights' mean, so only their shape changes).
    """

    selector: CandidateSelector
    weight: float = 1.0
    misses: str = "exclude"
    backbone_grad: bool = True
    uniform_weight: float | None = None

    def __post_init__(self) -> None:
        if self.misses not in SELECTOR_MISSES:
            raise ValueError(f"selector misses must be one of {SELECTOR_MISSES}: {self.misses!r}")


Weigh = Callable[[torch.Tensor], torch.Tensor]
"""Position weights of a micro-batch's rows from their (M,) confidences in the gold token."""


def selector_term(
    loss: SelectorLoss,
    rows: torch.Tensor,
    cand_logits: torch.Tensor,
    cand_ids: torch.Tensor,
    targets: DraftTargets,
    weigh: Weigh,
) -> tuple[torch.Tensor, ...]:
    """sum(w * selector CE), and per row: gold in the top K, selector correct, w * CE, w.

    rows: (M, H) draft states; cand_logits, cand_ids: (M, K + 1) from
    `fused_linear_cross_entropy_with_candidates` (top-K sorted, then the gold).
    """
    k = cand_ids.shape[1] - 1
    if not loss.backbone_grad:
        rows, cand_logits = rows.detach(), cand_logits.detach()
    pair = loss.selector.pair_scores(rows, targets.predecessors, cand_ids)  # (M, K + 1)
    scores = cand_logits + pair.float()
    hit = cand_ids[:, :k] == targets.labels[:, None]  # (M, K); at most one per row
    in_top = hit.any(1)
    gold_col = hit.float().argmax(1)  # 0 for a miss: masked below
    # What serving does: argmax over the K candidates (the gold is never added at inference).
    picked = scores[:, :k].argmax(1)
    correct = in_top & (picked == gold_col)
    if loss.misses == "inject":
        # The gold takes the weakest candidate's place (column K - 1 of the sorted top K).
        swapped = torch.cat([scores[:, : k - 1], scores[:, k:]], 1)
        logits = torch.where(in_top[:, None], scores[:, :k], swapped)
        label = torch.where(in_top, gold_col, torch.full_like(gold_col, k - 1))
    else:
        logits, label = scores[:, :k], gold_col
    ce = F.cross_entropy(logits, label, reduction="none")
    if loss.uniform_weight is not None:
        w = (targets.weights > 0).to(ce.dtype) * loss.uniform_weight
    else:
        # A miss is confidence 0, never 1: the selector cannot draft the gold there, so for
        # D-PACE the later positions' credit falls with it (injected or excluded alike).
        w = weigh(torch.where(in_top, torch.exp(-ce.detach()), torch.zeros_like(ce)))
    if loss.misses == "exclude":
        w = w * in_top
    weighted = w * ce
    return weighted.sum(), in_top, correct, weighted.detach(), w


def draft_loss(
    hidden: torch.Tensor,
    targets: DraftTargets,
    head_weight: torch.Tensor,
    block_size: int,
    chunk_rows: int,
    head_bias: torch.Tensor | None = None,
    selector: SelectorLoss | None = None,
    positions: PositionWeights = DECAY,
    loss: HeadLoss = CE,
    teacher: Teacher | None = None,
    rejected: DraftTargets | None = None,
) -> LossOutput:
    """Loss numerator and accuracy counts for one micro-batch (the divisor is known on the
    host: `Job.weight_sum`, see `loss_normaliser`).

    hidden: (batch, N * B, H) final-normed draft states; targets on the same device.
    selector: DFlash 2's selector term (None for DFlash 1).
    positions: the decay (the targets' host weights) or D-PACE (from the rows' confidences:
        `head_loss`'s, per loss).
    loss, teacher: each position's loss (`head_loss.HeadLoss`) and, for a loss on the target's
        distribution, the batch's teacher input.
    rejected: on-policy, the rejected-draft stream's rows (`on_policy.RoundBlocks.rejected`):
        their weighted k3 terms join the numerator (`rejected_term`).
    """
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, targets.select)
    top_k = 0 if selector is None else selector.selector.top_k
    teacher_rows, softcap = None, None
    if loss.needs_teacher:
        assert teacher is not None, f"loss {loss.kind} needs the teacher's input"
        states = teacher.states.reshape(-1, teacher.states.shape[-1])
        teacher_rows = states.index_select(0, targets.teacher_rows).to(rows.dtype)
        softcap = teacher.softcap
    per_row = fused_head_loss(
        rows, head_weight, targets.labels, chunk_rows, head_bias, top_k, loss, teacher_rows, softcap
    )
    num_blocks = hidden.shape[0] * hidden.shape[1] // block_size

    def weigh(confidence: torch.Tensor) -> torch.Tensor:
        if not positions.dynamic:
            return targets.weights
        return dpace_weights(confidence, targets.select, num_blocks, block_size, positions.alpha)

    w = weigh(per_row.confidence)  # (M,), no gradient through the weights
    loss_sum = (w * per_row.value).sum()
    dev = hidden.device

    def per_offset(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(block_size, device=dev).index_add_(0, targets.offsets, values.float())

    count = per_offset(torch.ones_like(targets.weights))
    stats = None
    if selector is not None:
        sel_sum, in_top, sel_correct, weighted_ce, sel_w = selector_term(
            selector, rows, per_row.cand_logits, per_row.cand_ids, targets, weigh
        )
        loss_sum = loss_sum + selector.weight * sel_sum
        per = [per_offset(v) for v in (in_top, sel_correct, weighted_ce, sel_w)]
        stats = torch.stack(per)
    rej = None
    if rejected is not None:
        assert teacher is not None, "the rejected-draft stream needs the teacher's input"
        rej = rejected_term(hidden, rejected, head_weight, head_bias, teacher, chunk_rows)
        loss_sum = loss_sum + rej
        rej = rej.detach().reshape(1)
    out = LossOutput(loss_sum, per_offset(per_row.correct), count, stats, per_offset(w))
    out.rejected = rej
    return out


def rejected_term(
    hidden: torch.Tensor,
    rejected: DraftTargets,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    teacher: Teacher,
    chunk_rows: int,
) -> torch.Tensor:
    """sum(weight x k3) over the rejected drafts (`opd_loss.rejected_k3`): the drafter's row at
    each rejected slot of `hidden` (batch, N * B, H) against the teacher's row before it."""
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rejected.select)
    states = teacher.states.reshape(-1, teacher.states.shape[-1])
    before = states.index_select(0, rejected.teacher_rows).to(rows.dtype)
    out = rejected_k3(
        rows, head_weight, rejected.labels, before, chunk_rows, head_bias, teacher.softcap
    )
    return (rejected.weights * out.value).sum()


def acceptance_estimate(correct: torch.Tensor, count: torch.Tensor) -> tuple[list[float], float]:
    """Per-offset accuracy acc_k (k = 1 .. B - 1) and the expected acceptance length
    1 + sum_k prod_{i <= k} acc_i (the anchor's bonus token counts 1, as in tau).

    Host sync: call at logging steps only.
    """
    c, n = correct.double().cpu(), count.double().cpu()
    acc = torch.where(n[1:] > 0, c[1:] / n[1:].clamp(min=1), torch.zeros_like(n[1:]))
    return acc.tolist(), float(1.0 + torch.cumprod(acc, 0).sum())


def selector_estimates(
    selector: torch.Tensor, count: torch.Tensor
) -> tuple[list[float], list[float], float, float]:
    """From DFlash 2's summed (4, B) statistics and the (B,) counts: per offset k = 1 .. B - 1
    the top-K recall of the gold token and the teacher-forced selector accuracy, the expected
    acceptance length of the selector's path, and sum(w * selector CE).

    Teacher forcing is exact for the estimate: a draft is only verified after every earlier one
    was accepted, i.e. when its predecessor was the gold token. Host sync: log steps only.
    """
    stats, n = selector.double().cpu(), count.double().cpu()[1:].clamp(min=1)
    recall = (stats[0, 1:] / n).tolist()
    acc, tau = acceptance_estimate(selector[1], count)
    return recall, acc, tau, float(stats[2].sum())


def make_layout(
    anchors: torch.Tensor, valid: torch.Tensor, block_size: int, device, num_chunks: int = 8
) -> BlockLayout:
    """The attention layout of a batch (thin alias so callers need only this module)."""
    return BlockLayout.build(anchors, valid, block_size, device, num_chunks)


def blocks_per_rows(max_anchors: np.ndarray, num_anchors: int) -> np.ndarray:
    """`blocks_per_row` of many anchor counts at once (int64, the same numbers): each count
    rounded up to a power of two, at least 16 (`round_up_pow2`), at most `num_anchors`."""
    counts = np.maximum(np.asarray(max_anchors, dtype=np.int64), 1)
    # 2 ** ceil(log2(n)) is the first power of two >= n: exact in integers, unlike a log.
    powers = np.left_shift(np.int64(1), np.arange(63, dtype=np.int64))
    rounded = powers[np.searchsorted(powers, counts, side="left")]
    return np.minimum(num_anchors, np.maximum(16, rounded))
