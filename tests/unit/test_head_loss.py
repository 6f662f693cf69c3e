"""The LM-head losses on the target's distribution (KL, LK^alpha, LK^lambda) and the hard CE:
values, confidences and gradients against direct full-vocabulary definitions in float64, at
every chunk size; the teacher's shift; D-PACE's confidence per loss; the memory bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_position_weights import block_case

from dflash_train.head_loss import LK_ALPHA_EPS, LOSSES, HeadLoss, Teacher, fused_head_loss
from dflash_train.objective import draft_loss
from dflash_train.position_weights import PositionWeights, dpace_weights

ROWS, HIDDEN, VOCAB = 29, 12, 41


def case(seed: int = 0, dtype=torch.float64, overlap: float = 0.7):
    """Draft rows, teacher rows that partly agree with them (alpha well inside (0, 1)), a head
    with bias, labels, and row weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen, dtype=dtype)
    noise = torch.randn(ROWS, HIDDEN, generator=gen, dtype=dtype)
    teacher = overlap * hidden + (1 - overlap) * noise
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype)
    bias = torch.randn(VOCAB, generator=gen, dtype=dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    w = torch.rand(ROWS, generator=gen, dtype=dtype)
    return hidden, teacher, head, bias, labels, w


def direct(hidden, teacher, head, bias, labels, loss: HeadLoss, cap=None):
    """(value, confidence) per row from the full-vocabulary distributions, by the definitions."""
    z = hidden @ head.T + bias
    t = teacher @ head.T + bias
    if cap is not None:
        t = cap * torch.tanh(t / cap)
    log_q, log_p = z.log_softmax(-1), t.log_softmax(-1)
    q, p = log_q.exp(), log_p.exp()
    gold_q = q.gather(1, labels[:, None]).squeeze(1)
    if loss.kind == "ce":
        return -gold_q.log(), gold_q.detach()
    kl = (p * (log_p - log_q)).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if loss.kind == "kl":
        return kl, gold_q.detach()
    if loss.kind == "lk_alpha":
        return -torch.log(alpha + LK_ALPHA_EPS), alpha.detach()
    lam = torch.exp(-loss.lk_eta * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha), alpha.detach()


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("chunk", [1, 4, 11, ROWS, 100])
def test_each_loss_equals_its_definition_with_gradients_at_every_chunk_size(kind, chunk):
    hidden, teacher, head, bias, labels, w = case()
    loss = HeadLoss(kind, lk_eta=2.5)
    x = hidden.clone().requires_grad_()
    want, want_conf = direct(x, teacher, head, bias, labels, loss)
    (g_want,) = torch.autograd.grad((w * want).sum(), x)
    y = hidden.clone().requires_grad_()
    t = teacher.clone().requires_grad_()  # the teacher is detached inside: no gradient reaches it
    rows = fused_head_loss(y, head, labels, chunk, bias, loss=loss, teacher=t)
    (w * rows.value).sum().backward()
    torch.testing.assert_close(rows.value, want.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(rows.confidence, want_conf, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(y.grad, g_want, atol=1e-12, rtol=1e-10)
    assert t.grad is None
    assert torch.equal(rows.correct, (hidden @ head.T + bias).argmax(-1) == labels)
    _, alpha = direct(hidden, teacher, head, bias, labels, HeadLoss("lk_alpha"))
    assert float(alpha.min()) > 0.05 and float(alpha.max()) < 0.99  # no row at either end


@pytest.mark.parametrize("kind", ["kl", "lk_alpha", "lk_lambda"])
def test_the_teacher_takes_the_targets_final_logit_soft_cap(kind):
    hidden, teacher, head, bias, labels, w = case(seed=1)
    head = head * 4  # logits beyond the cap, so capping changes them
    loss = HeadLoss(kind)
    x = hidden.clone().requires_grad_()
    want, _ = direct(x, teacher, head, bias, labels, loss, cap=5.0)
    (g_want,) = torch.autograd.grad((w * want).sum(), x)
    uncapped, _ = direct(hidden, teacher, head, bias, labels, loss)
    assert not torch.allclose(uncapped, want.detach(), atol=1e-3)  # the test can tell
    y = hidden.clone().requires_grad_()
    rows = fused_head_loss(y, head, labels, 7, bias, loss=loss, teacher=teacher, softcap=5.0)
    (g,) = torch.autograd.grad((w * rows.value).sum(), y)
    torch.testing.assert_close(rows.value, want.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g, g_want, atol=1e-12, rtol=1e-10)


def test_kl_is_the_soft_cross_entropy_less_the_teachers_entropy():
    hidden, teacher, head, bias, labels, _ = case(seed=2)
    rows = fused_head_loss(hidden, head, labels, 5, bias, loss=HeadLoss("kl"), teacher=teacher)
    p = (teacher @ head.T + bias).softmax(-1)
    log_q = (hidden @ head.T + bias).log_softmax(-1)
    soft_ce = -(p * log_q).sum(-1)  # Model-Optimizer's KD loss
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(rows.value, soft_ce - entropy, atol=1e-12, rtol=1e-10)
    assert float(rows.value.min()) >= 0


def test_a_teacher_equal_to_the_drafter_gives_zero_kl_and_full_acceptance():
    hidden, _, head, bias, labels, _ = case(seed=3)
    for kind, value in (("kl", 0.0), ("lk_alpha", -np.log1p(LK_ALPHA_EPS)), ("lk_lambda", 0.0)):
        y = hidden.clone().requires_grad_()
        rows = fused_head_loss(y, head, labels, 6, bias, loss=HeadLoss(kind), teacher=hidden)
        rows.value.sum().backward()
        torch.testing.assert_close(
            rows.value, torch.full_like(rows.value, value), atol=1e-9, rtol=0
        )
        assert float(y.grad.abs().max()) < 1e-9  # the optimum: nothing to learn
        if kind != "kl":
            torch.testing.assert_close(rows.confidence, torch.ones_like(rows.confidence))


def test_lk_alpha_keeps_a_bounded_finite_gradient_when_the_two_barely_overlap():
    # head = identity: the rows are the logits, so the gradient w.r.t. them is d loss / d z.
    eye = torch.eye(8, dtype=torch.float64)
    z = torch.full((3, 8), -40.0, dtype=torch.float64)
    z[:, 0] = 40.0  # the drafter is sure of token 0
    t = torch.full((3, 8), -40.0, dtype=torch.float64)
    t[:, 1] = 40.0  # the target of token 1: alpha ~ 1e-35
    z[2], t[2] = -4000.0, -4000.0  # here each side underflows off its token: alpha = 0 exactly
    z[2, 0], t[2, 1] = 4000.0, 4000.0
    y = z.clone().requires_grad_()
    labels = torch.ones(3, dtype=torch.long)
    rows = fused_head_loss(y, eye, labels, 2, loss=HeadLoss("lk_alpha"), teacher=t)
    rows.value.sum().backward()
    assert torch.isfinite(rows.value).all() and torch.isfinite(y.grad).all()
    assert float(rows.confidence[2]) == 0.0
    assert float(y.grad.abs().sum(-1).max()) <= 2.0 + 1e-9  # |grad|_1 <= 2 whatever alpha is
    assert float(y.grad[0, 0]) > 0 and float(y.grad[0, 1]) < 0  # token 0 down, token 1 up


def test_a_teacher_loss_without_the_teachers_rows_is_refused():
    hidden, _, head, _, labels, _ = case()
    with pytest.raises(ValueError, match="teacher rows None"):
        fused_head_loss(hidden, head, labels, 4, loss=HeadLoss("kl"))
    with pytest.raises(ValueError, match="loss must be one of"):
        HeadLoss("tv")
    with pytest.raises(ValueError, match="lk_eta"):
        HeadLoss("lk_lambda", lk_eta=0.0)


def test_the_teacher_losses_never_keep_full_vocabulary_logits():
    # 64 rows x 4096 tokens: one chunk of logits of each side at a time (16 rows), and nothing
    # of rows x vocabulary saved for backward.
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(64, 12, generator=gen)
    head = torch.randn(4096, 12, generator=gen)
    labels = torch.randint(0, 4096, (64,), generator=gen)
    for kind in ("kl", "lk_alpha", "lk_lambda"):
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        x = hidden.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            rows = fused_head_loss(
                x, head, labels, 16, loss=HeadLoss(kind), teacher=torch.randn(64, 12)
            )
            rows.value.sum().backward()
        big = [n for n in saved if n != head.numel()]  # the head is saved by reference
        assert max(big) < 64 * 4096 // 8, (kind, sorted(big)[-4:])


# ----------------------------------------------------------------------------- in draft_loss
def test_the_teacher_of_x_p_plus_k_is_the_target_at_p_plus_k_minus_1():
    c = block_case(vocab=VOCAB)
    ids, anchors, targets = c.ids, c.anchors, c.targets
    length = ids.shape[1]
    row = targets.select // (anchors.shape[1] * 4)
    block = (targets.select // 4) % anchors.shape[1]
    p_plus_k = anchors[row, block] + targets.offsets
    torch.testing.assert_close(targets.teacher_rows, row * length + p_plus_k - 1)
    assert torch.equal(ids.flatten()[targets.teacher_rows], targets.predecessors)
    assert torch.equal(ids.flatten()[targets.teacher_rows + 1], targets.labels)
    parts = targets.split_by_chunks(3, 4, [(0, 1, 0), (1, 3, 0)])

    # Each chunk's rows keep their teacher rows (indices into the whole batch's positions).
    def pairs(*parts_):
        pos = [(t.labels.tolist(), t.teacher_rows.tolist()) for t in parts_]
        return sorted((y, r) for ys, rs in pos for y, r in zip(ys, rs, strict=True))

    assert pairs(*parts) == pairs(targets)


@pytest.mark.parametrize("kind", ["kl", "lk_alpha", "lk_lambda"])
@pytest.mark.parametrize("weights", ["decay", "dpace"])
def test_draft_loss_reads_the_teacher_at_the_shifted_positions_with_its_confidences(kind, weights):
    c = block_case(vocab=VOCAB)
    anchors, targets, states, teacher, head, size = (
        c.anchors, c.targets, c.states, c.teacher, c.head, c.size
    )  # fmt: skip
    loss = HeadLoss(kind)
    rows = states.reshape(-1, states.shape[-1])[targets.select].double().requires_grad_()
    shifted = torch.stack(
        [teacher[r, int(a) + int(k) - 1] for r, a, k in _row_anchor_offset(targets, anchors, size)]
    ).double()
    value, conf = direct(
        rows, shifted, head.double(), torch.zeros(VOCAB).double(), targets.labels, loss
    )
    positions = PositionWeights(weights)
    num_blocks = anchors.numel()
    if weights == "dpace":
        w = dpace_weights(conf, targets.select, num_blocks, size, positions.alpha).double()
    else:
        w = targets.weights.double()
    want = (w * value).sum()
    (g_want,) = torch.autograd.grad(want, rows)
    h = states.clone().requires_grad_()
    out = draft_loss(
        h, targets, head, size, 3, positions=positions, loss=loss, teacher=Teacher(teacher)
    )
    (g,) = torch.autograd.grad(out.loss_sum, h)
    torch.testing.assert_close(out.loss_sum.double(), want.detach(), atol=1e-4, rtol=1e-5)
    g_rows = g.reshape(-1, g.shape[-1])[targets.select].double()
    torch.testing.assert_close(g_rows, g_want, atol=1e-5, rtol=1e-4)


def _row_anchor_offset(targets, anchors, size):
    n = anchors.shape[1]
    for s, k in zip(targets.select.tolist(), targets.offsets.tolist(), strict=True):
        r, b = s // (n * size), (s // size) % n
        yield r, anchors[r, b], k


def test_dpace_confidence_is_q_gold_for_ce_and_kl_and_alpha_for_lk():
    hidden, teacher, head, bias, labels, _ = case(seed=5)
    q_gold = (hidden @ head.T + bias).softmax(-1).gather(1, labels[:, None]).squeeze(1)
    p = (teacher @ head.T + bias).softmax(-1)
    alpha = torch.minimum(p, (hidden @ head.T + bias).softmax(-1)).sum(-1)
    for kind, want in (("ce", q_gold), ("kl", q_gold), ("lk_alpha", alpha), ("lk_lambda", alpha)):
        rows = fused_head_loss(hidden, head, labels, 8, bias, loss=HeadLoss(kind), teacher=teacher)
        torch.testing.assert_close(rows.confidence, want, atol=1e-12, rtol=1e-10)
        assert not rows.confidence.requires_grad
