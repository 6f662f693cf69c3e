"""Draft-OPD's rejected-draft stream: a reverse-KL term at each draft token verification rejected.

At a rejected draft y (offset k of a round anchored at a), with the drafter's log q(y) from its
state at that block slot and the target's log p(y) from its teacher-forced distribution for
position a + k (its LM head on its final-normed last hidden state at a + k - 1, as the losses on
the target's distribution use), r = log p(y) - log q(y) and the term is the k3 estimator of
KL(q || p) from the sample y ~ q: exp(r) - 1 - r (>= 0, 0 iff p(y) = q(y); Draft-OPD's choice,
verl's "low_var_kl"). Its gradient with respect to the drafter's logits z is
(1 - exp(r)) (onehot(y) - q): where the target gives the rejected token less than the drafter
(r < 0) it lowers q(y), by at most the CE-sized step (onehot(y) - q).

Bounded as Draft-OPD's scripts bound it: both log-probabilities are floored at `LOG_PROB_FLOOR`
and the term is capped at `K3_CAP`, with no gradient where either binds (the drafter's log q(y)
below the floor, or the term above the cap). Without them the factor exp(r) - 1 grows without
bound where the drafter gives y far less than the target: a DFlash 2 selector can pick a token
whose unary q(y) is 1e-4, and one such row would set the clipped step's direction. With them
the factor lies in [-1, expm1(K3_CAP's r)] (about 12.6); the drafter's confident mistakes
(r < 0) keep their whole gradient down to r = -10.

The head runs in row chunks and d value / d hidden is computed in forward (as `head_loss`):
one chunk of fp32 logits of each side at a time, none kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.model.target import soft_cap

LOG_PROB_FLOOR = -10.0
"""Both sides' log-probabilities of the rejected token are floored here (Draft-OPD's -10)."""
K3_CAP = 10.0
"""The k3 term's cap (Draft-OPD clamps its loss at 10): reached at r ~ 2.61, p(y) ~ 13.6 q(y)."""


@dataclass
class RejectedRows:
    """Per rejected draft (R of them): the k3 value (differentiable w.r.t. the drafter's
    rows), and the detached log q(y) and log p(y)."""

    value: torch.Tensor
    log_q: torch.Tensor
    log_p: torch.Tensor


def k3(r: torch.Tensor) -> torch.Tensor:
    """exp(r) - 1 - r: the k3 estimate of KL(q || p) from a sample with r = log p - log q."""
    return torch.expm1(r) - r


class _RejectedK3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, teacher, chunk_rows: int, softcap):
        m = hidden.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        value, log_q, log_p = (torch.empty(m, dtype=acc, device=hidden.device) for _ in range(3))
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for lo in range(0, m, chunk_rows):
            hi = min(m, lo + chunk_rows)
            y = tokens[lo:hi, None]
            z = F.linear(hidden[lo:hi], weight, bias).to(acc)  # (C, vocab) the drafter's logits
            t = soft_cap(F.linear(teacher[lo:hi], weight, bias).to(acc), softcap)
            lq = z.gather(1, y)[:, 0] - torch.logsumexp(z, -1)
            lp = t.gather(1, y)[:, 0] - torch.logsumexp(t, -1)
            del t
            r = lp.clamp(min=LOG_PROB_FLOOR) - lq.clamp(min=LOG_PROB_FLOOR)
            raw = k3(r)
            value[lo:hi], log_q[lo:hi], log_p[lo:hi] = raw.clamp(max=K3_CAP), lq, lp
            if grad is not None:
                q = torch.softmax(z, -1)
                dz = q.scatter_add_(1, y, -torch.ones_like(lq)[:, None])  # q - onehot(y)
                # (1 - e^r)(onehot - q) = (e^r - 1)(q - onehot); none where a bound binds
                live = (lq >= LOG_PROB_FLOOR) & (raw <= K3_CAP)
                dz.mul_(torch.where(live, torch.expm1(r), 0.0)[:, None])
                grad[lo:hi] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(log_q, log_p)
        return value, log_q, log_p

    @staticmethod
    def backward(ctx, grad_value, _lq, _lp):
        (grad,) = ctx.saved_tensors
        if grad is None:
            return (None,) * 7
        return grad * grad_value[:, None].to(grad.dtype), None, None, None, None, None, None


def rejected_k3(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    teacher: torch.Tensor,
    chunk_rows: int,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> RejectedRows:
    """The k3 term of each rejected draft: the drafter's rows `hidden` (R, H) under the frozen
    head `weight` (V, H) / `bias`, the rejected tokens (R,), the teacher's input rows `teacher`
    (R, H) (the target's final-normed last hidden state before each rejected slot) and the
    target's final logit soft cap."""
    if chunk_rows < 1:
        raise ValueError(f"loss chunk size must be >= 1, got {chunk_rows}")
    out = _RejectedK3.apply(hidden, weight, bias, tokens, teacher.detach(), chunk_rows, softcap)
    return RejectedRows(*out)
