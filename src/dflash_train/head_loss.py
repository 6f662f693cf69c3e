"""The LM-head loss of each supervised block position, fused with its gradient and chunked.

Per supervised row m (a block anchored at p, offset k), the drafter's logits are z = W h_m + b
(W, b: the target's frozen LM head) and q = softmax(z). The losses on the target's own
distribution compare q with p = softmax(t), t = cap(W h^T_m + b): h^T_m is the target's
final-normed LAST hidden state at position p + k - 1 of the training row (teacher-forced,
detached: the target's next-token distribution for x[p + k]), cap its final logit soft cap
(Gemma 2; none for most families). No temperature (T = 1).

- ce: -log q(y), y = x[p + k], the data's token (the paper's loss; the default).
- kl: KL(p || q) = sum_v p_v (log p_v - log q_v), the soft cross-entropy -sum_v p_v log q_v
  (Model-Optimizer's DFlash default) minus the teacher's entropy: the same gradient, q - p, and a
  value that is 0 at the optimum.
- lk_alpha: -log(alpha + eps), alpha = sum_v min(p_v, q_v), the acceptance rate of speculative
  sampling (LK^alpha, arXiv 2602.23881; speculators' "nla"). eps only keeps alpha = 0 (every
  token's mass underflowing on one side) finite: the gradient of -log alpha with respect to z is
  bounded (its L1 norm is at most 2) however small alpha is.
- lk_lambda: lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = exp(-eta sg(alpha)) (LK^lambda,
  the paper's best at eta = 3): KL where the two disagree, the acceptance rate where they agree.

Gradients with respect to the drafter's logits, per row: ce q - onehot(y); kl q - p; and
d alpha / d z_j = q_j ([q_j < p_j] - S), S = sum over {v: q_v < p_v} of q_v (min(p, q) follows q
exactly where q is below p), so lk_alpha gives -(d alpha / d z) / (alpha + eps) and lk_lambda
lambda (q - p) - (1 - lambda) d alpha / d z.

Each row also has a confidence for D-PACE's position weights (`position_weights.dpace_weights`):
the probability that the position is accepted, as the loss models it. ce and kl: q(y), the
drafter's probability of the data's token (at T = 0, on data the target regenerated, a draft is
accepted exactly when it is that token); lk_alpha and lk_lambda: alpha, the acceptance rate the
loss maximises, so that sum_j w_j (-log alpha_j) with D-PACE's detached weights has the gradient
of the block's expected accepted length sum_m prod_{i <= m} alpha_i.

Memory: at a time one chunk of rows x vocabulary of draft logits, one of teacher logits and one
work buffer, in fp32 (fp64 when the inputs are), and a bool mask of that shape for LK; d loss /
d hidden (rows x hidden) is computed in forward and kept for backward; nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.config import LOSSES
from dflash_train.model.target import soft_cap

LK_ALPHA_EPS = 1e-6
"""Added to alpha inside lk_alpha's logarithm (see the module docstring)."""


@dataclass(frozen=True)
class HeadLoss:
    """Which loss each supervised position takes (see the module docstring).

    kind: ce (the data's tokens), kl, lk_alpha or lk_lambda (the target's distribution).
    lk_eta: lk_lambda's eta in lambda = exp(-eta sg(alpha)), > 0.
    """

    kind: str = "ce"
    lk_eta: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}: {self.kind!r}")
        if not self.lk_eta > 0:
            raise ValueError(f"lk_eta must be positive, got {self.lk_eta}")

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss reads the target's distribution (the teacher's input)."""
        return self.kind != "ce"


CE = HeadLoss()
"""Hard cross-entropy on the data's tokens (the default)."""


@dataclass(frozen=True)
class Teacher:
    """The teacher's input of a micro-batch: the target's final-normed last hidden states
    (batch, L, H) of its rows (teacher-forced, no gradient), and the target's final logit soft
    cap (None for most families)."""

    states: torch.Tensor
    softcap: float | None = None


@dataclass
class RowLosses:
    """Per supervised row (M of them): value (differentiable w.r.t. the hidden rows), confidence
    (detached, D-PACE's), top-1 correctness against the data's token, and for DFlash 2's selector
    each row's top-k draft logits then the gold's (M, k + 1, differentiable) and their ids."""

    value: torch.Tensor
    confidence: torch.Tensor
    correct: torch.Tensor
    cand_logits: torch.Tensor
    cand_ids: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """The non-tensor settings of one fused call."""

    chunk_rows: int
    top_k: int
    loss: HeadLoss
    softcap: float | None


class _FusedHeadLoss(torch.autograd.Function):
    """Per-row losses of hidden @ W^T + b (see `fused_head_loss`); d value_m / d hidden_m is
    computed chunk by chunk in forward (the caller weighs the rows: D-PACE's weights depend on
    the rows' confidences), and backward scales it by each row's weight."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, teacher, plan: _Plan):
        m, k = hidden.shape[0], plan.top_k
        dev = hidden.device
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        value = torch.empty(m, dtype=acc, device=dev)
        confidence = torch.empty(m, dtype=acc, device=dev)
        correct = torch.empty(m, dtype=torch.bool, device=dev)
        cand_logits = torch.empty(m, k + 1 if k else 0, dtype=acc, device=dev)
        cand_ids = torch.empty(m, k + 1 if k else 0, dtype=torch.long, device=dev)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        for lo in range(0, m, plan.chunk_rows):
            hi = min(m, lo + plan.chunk_rows)
            z = F.linear(hidden[lo:hi], weight, bias).to(acc)  # (C, vocab) draft logits
            y = labels[lo:hi]
            lse = torch.logsumexp(z, dim=-1)
            gold = z.gather(1, y[:, None]).squeeze(1)
            correct[lo:hi] = z.argmax(-1) == y
            if k:
                # Sorted descending: column k - 1 is the weakest candidate, column k the gold.
                vals, ids = z.topk(k, dim=-1)
                cand_logits[lo:hi] = torch.cat([vals, gold[:, None]], 1)
                cand_ids[lo:hi] = torch.cat([ids, y[:, None]], 1)
            if plan.loss.needs_teacher:
                t = soft_cap(F.linear(teacher[lo:hi], weight, bias).to(acc), plan.softcap)
                v, conf, dz = teacher_rows(z, t, lse, gold, plan.loss)
            else:
                v, conf, dz = hard_ce_rows(z, y, lse, gold)
            value[lo:hi], confidence[lo:hi] = v, conf
            if need_grad:
                grad[lo:hi] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)  # (C, H)
        ctx.save_for_backward(grad, weight if k else None, cand_ids)
        ctx.mark_non_differentiable(confidence, correct, cand_ids)
        return value, confidence, correct, cand_logits, cand_ids

    @staticmethod
    def backward(ctx, grad_value, _conf, _correct, grad_cand, _ids):
        grad, weight, cand_ids = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None
        g = grad * grad_value[:, None].to(grad.dtype)  # each row's weight, d loss / d value_m
        if grad_cand is not None and cand_ids.numel():
            # d cand_logit[m, j] / d hidden[m] = W[cand_ids[m, j]]: gathered a few rows at a time
            # ((rows, k + 1, H) in the head's dtype stays within ~64 MiB).
            per_row = cand_ids.shape[1] * weight.shape[1] * weight.element_size()
            step = max(1, (64 << 20) // per_row)
            for lo in range(0, g.shape[0], step):
                rows = weight[cand_ids[lo : lo + step]]  # (rows, k + 1, H)
                part = torch.einsum("mj,mjh->mh", grad_cand[lo : lo + step].to(rows.dtype), rows)
                g[lo : lo + step] += part.to(g.dtype)
        return g, None, None, None, None, None


def hard_ce_rows(
    z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, gold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value, confidence, d value / d z) of -log q(y) for a chunk of draft logits z (C, V),
    given its logsumexp and gold logits (C,); z's buffer becomes the gradient q - onehot(y)."""
    value = lse - gold
    dz = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    dz[torch.arange(len(labels), device=z.device), labels] -= 1.0
    return value, torch.exp(-value), dz


def teacher_rows(
    z: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, gold: torch.Tensor, loss: HeadLoss
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value, confidence, d value / d z) of `loss` for a chunk of draft logits z and teacher
    logits t (C, V) each, given z's logsumexp and gold logits (C,) (the formulas: the module
    docstring). Both buffers are consumed in place; the gradient is returned in one of them."""
    log_q = z.sub_(lse[:, None])
    log_p = t.sub_(torch.logsumexp(t, dim=-1)[:, None])
    work = kl = None
    if loss.kind in ("kl", "lk_lambda"):
        work = log_p - log_q  # (C, V): the one buffer beyond the two chunks of logits
    p = log_p.exp_()  # t's buffer now holds p
    if work is not None:
        kl = work.mul_(p).sum(-1)
    q = log_q.exp_()  # z's buffer now holds q
    if loss.kind == "kl":
        return kl, torch.exp(gold - lse), q.sub_(p)
    work = torch.minimum(p, q) if work is None else torch.minimum(p, q, out=work)
    alpha = work.sum(-1)
    below = work.copy_(q).mul_(q < p)  # q where q is below p, else 0
    d_alpha = below.addcmul_(q, below.sum(-1)[:, None], value=-1.0)  # q ([q < p] - S)
    if loss.kind == "lk_alpha":
        denom = alpha + LK_ALPHA_EPS
        return -torch.log(denom), alpha, d_alpha.div_(-denom[:, None])
    lam = torch.exp(-loss.lk_eta * alpha)  # sg(alpha): a constant of the gradient
    value = lam * kl + (1.0 - lam) * (1.0 - alpha)
    dz = q.sub_(p).mul_(lam[:, None]).sub_(d_alpha.mul_((1.0 - lam)[:, None]))
    return value, alpha, dz


def fused_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int,
    bias: torch.Tensor | None = None,
    top_k: int = 0,
    loss: HeadLoss = CE,
    teacher: torch.Tensor | None = None,
    softcap: float | None = None,
) -> RowLosses:
    """Per-row losses of the drafter's rows `hidden` (M, H) under the frozen head `weight`
    (V, H) and `bias`, against the data's tokens `labels` (M,) and, for a teacher loss, the
    target's final-normed last hidden states `teacher` (M, H) at the rows' shifted positions
    (its head's final logit soft cap `softcap`). Never more than one chunk of full-vocabulary
    logits of each side at a time, and none kept for backward."""
    if chunk_rows < 1:
        raise ValueError(f"loss chunk size must be >= 1, got {chunk_rows}")
    if loss.needs_teacher:
        if teacher is None or teacher.shape != hidden.shape:
            got = None if teacher is None else tuple(teacher.shape)
            raise ValueError(f"loss {loss.kind}: teacher rows {got}, need {tuple(hidden.shape)}")
        teacher = teacher.detach()
    plan = _Plan(chunk_rows, top_k, loss, softcap)
    return RowLosses(*_FusedHeadLoss.apply(hidden, weight, bias, labels, teacher, plan))


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
    rows = fused_head_loss(hidden, weight, labels, chunk_rows, bias)
    return (w * rows.value).sum(), rows.correct


def auto_chunk_rows(vocab_size: int, budget_bytes: int = 64 << 20) -> int:
    """Rows per loss chunk: one chunk of fp32 logits within `budget_bytes`
    (`loss_chunk_bytes`), clamped to [512, 4096] rows (fewer rows starve a GPU matmul; more
    only grow memory; on CPU 1K-16K rows measured the same speed for a 2K vocabulary)."""
    return int(min(4096, max(512, budget_bytes // (4 * vocab_size))))


CUDA_LOSS_CHUNK_SHARE = 64
"""On CUDA one chunk of fp32 logits may take 1/64 of the device's memory (an H200's: 2.3 GB,
~3,900 rows of a 152K vocabulary; a loss on the target's distribution holds three such
buffers): each chunk costs some 35 launches whatever its size, and with 64 MiB chunks the
loss was half of a Qwen3-8B micro-step's operations in one pass (`bench dispatch`)."""


def loss_chunk_bytes(device: torch.device) -> int:
    """The budget of one chunk of fp32 logits: 64 MiB on CPU, `CUDA_LOSS_CHUNK_SHARE` of the
    device's memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // CUDA_LOSS_CHUNK_SHARE
    return 64 << 20
