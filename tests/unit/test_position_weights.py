"""D-PACE position weights: the formula, no gradient through them, the end of the product, the
normaliser, and DFlash 2's miss rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_objective import selector_case

from dflash_train.objective import (
    DraftTargets,
    SelectorLoss,
    block_targets,
    decay_weights,
    draft_loss,
    pack_anchors,
)
from dflash_train.position_weights import PositionWeights, dpace_weights, loss_normaliser


def direct_weights(q: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """w_j = sum_{m >= j} prod_{i <= m} q~_i per block, one block and one position at a time,
    with the product ended (0) at the first unsupervised offset."""
    blocks, size = q.shape
    w = torch.zeros(blocks, size)
    for b in range(blocks):
        for j in range(1, size):
            if not supervised[b, j]:
                continue
            total = 0.0
            for m in range(j, size):
                prod = 1.0
                for i in range(1, m + 1):
                    prod *= (1 - alpha) * float(q[b, i]) + alpha if supervised[b, i] else 0.0
                total += prod
            w[b, j] = total
    return w


@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_dpace_weights_equal_the_formula_per_block(alpha):
    gen = torch.Generator().manual_seed(0)
    blocks, size = 5, 6
    q = torch.rand(blocks, size, generator=gen)
    supervised = torch.rand(blocks, size, generator=gen) > 0.2
    supervised[:, 0] = False  # the anchor carries no loss
    supervised[3, 3] = False  # a gap: offsets 4 and 5 of block 3 get no credit
    supervised[4] = False  # a padding block
    select = torch.nonzero(supervised.flatten()).squeeze(1)
    got = dpace_weights(q.flatten()[select], select, blocks, size, alpha)
    want = direct_weights(q, supervised, alpha).flatten()[select]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if alpha == 1.0:  # q~ = 1: w_j = the number of supervised offsets from j to the gap
        full = torch.tensor([supervised[b, 1:].all() for b in range(blocks)])
        for b in torch.nonzero(full).flatten().tolist():
            rows = (select // size) == b
            assert got[rows].tolist() == [float(size - j) for j in range(1, size)]


def test_an_unsupervised_position_ends_the_product():
    size = 5
    supervised = torch.tensor([[False, True, True, False, True]])
    select = torch.nonzero(supervised.flatten()).squeeze(1)
    w = dpace_weights(torch.full((3,), 0.9), select, 1, size, 0.5)
    q = 0.5 * 0.9 + 0.5
    assert w.tolist() == pytest.approx([q + q * q, q * q, 0.0])


def test_dpace_weights_carry_no_gradient():
    conf = torch.rand(6, requires_grad=True)
    w = dpace_weights(conf, torch.arange(1, 7), 1, 8, 0.5)
    assert not w.requires_grad


def block_case(seed=0, vocab=30, hidden=10) -> SimpleNamespace:
    """Two rows of 20 tokens, anchors making full and truncated blocks and a padding block; a
    head whose logits make some confidences high (so D-PACE weights differ from a constant);
    the draft states (batch, N * B, hidden) and the rows' teacher states (batch, L, hidden)."""
    gen = torch.Generator().manual_seed(seed)
    length, size = 20, 4
    ids = torch.randint(0, vocab, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.uint8)
    mask[1, 12] = 0
    anchors, valid = pack_anchors([np.array([0, 5, 17]), np.array([9])], 3)
    targets = block_targets(ids, mask, anchors, valid, size, 4.0)
    states = torch.randn(2, 3 * size, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen)
    teacher = torch.randn(2, length, hidden, generator=gen)
    return SimpleNamespace(
        ids=ids, anchors=anchors, valid=valid, targets=targets, states=states, head=head,
        size=size, teacher=teacher,
    )  # fmt: skip


def dpace_case(seed=0, vocab=30, hidden=10):
    c = block_case(seed, vocab, hidden)
    return c.states, c.head, c.targets, c.valid, c.size


def test_the_dpace_loss_is_sum_w_ce_with_w_detached():
    states, head, targets, _valid, size = dpace_case()
    rows = states.reshape(-1, states.shape[-1])[targets.select]
    x = rows.clone().requires_grad_()
    ce = F.cross_entropy(x @ head.T, targets.labels, reduction="none")
    w = dpace_weights(torch.exp(-ce), targets.select, 6, size, 0.5)
    want = (w * ce).sum()
    (g_want,) = torch.autograd.grad(want, x)
    # With the weights differentiated too, the gradient would differ: the test can tell.
    ce2 = F.cross_entropy(x @ head.T, targets.labels, reduction="none")
    attached = _attached_weights(torch.exp(-ce2), targets.select, 6, size, 0.5)
    (g_attached,) = torch.autograd.grad((attached * ce2).sum(), x)
    assert not torch.allclose(g_attached, g_want, atol=1e-4)

    h = states.clone().requires_grad_()
    out = draft_loss(h, targets, head, size, chunk_rows=3, positions=PositionWeights("dpace"))
    (g,) = torch.autograd.grad(out.loss_sum, h)
    torch.testing.assert_close(out.loss_sum, want.detach(), atol=1e-5, rtol=1e-5)
    g_rows = g.reshape(-1, g.shape[-1])[targets.select]
    torch.testing.assert_close(g_rows, g_want, atol=1e-5, rtol=1e-5)
    # Per offset: where the weight went (train/pos_weight_k = pos_weight / count).
    per = torch.zeros(size).index_add_(0, targets.offsets, w)
    torch.testing.assert_close(out.pos_weight, per)


def _attached_weights(conf, select, blocks, size, alpha):
    grid = torch.zeros(blocks * size).index_put((select,), (1 - alpha) * conf + alpha)
    grid = torch.cat([torch.ones(blocks, 1), grid.view(blocks, size)[:, 1:]], 1)
    prefix = torch.cumprod(grid, 1)
    return prefix.flip(1).cumsum(1).flip(1).flatten()[select]


def test_the_decay_keeps_its_host_weights_and_reports_them_per_offset():
    states, head, targets, _valid, size = dpace_case()
    out = draft_loss(states, targets, head, size, chunk_rows=4)
    want = (decay_weights(size, 4.0) * out.count).float()
    torch.testing.assert_close(out.pos_weight, want)


def test_normalisers_are_the_weight_sum_or_the_valid_anchors():
    _states, _head, targets, valid, _size = dpace_case()
    assert loss_normaliser(targets.weights, valid) == pytest.approx(float(targets.weights.sum()))
    assert loss_normaliser(targets.weights, valid, "dpace") == 4.0  # 3 + 1 anchors


def test_position_weights_refuse_an_alpha_outside_0_1():
    for alpha in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="dpace_alpha"):
            PositionWeights("dpace", alpha)
    with pytest.raises(ValueError, match="position weights"):
        PositionWeights("linear")


# ----------------------------------------------------------------------------- DFlash 2
def selector_reference(
    hidden, head, bias, targets, selector, misses, alpha, blocks, size, miss=0.0
):
    """The selector term under D-PACE from dense logits: confidence = the selector's softmax
    probability of the gold among the top K, and `miss` (0: the selector cannot draft it) for a
    gold outside the top K."""
    logits = hidden @ head.T + bias
    k = selector.top_k
    conf, ces, keep = [], [], []
    for m in range(hidden.shape[0]):
        cands = logits[m].topk(k).indices
        gold = int(targets.labels[m])
        query = (
            selector.hidden_projection(hidden[m])
            * selector.predecessor_codebook[targets.predecessors[m]]
        )
        inside = bool((cands == gold).any())
        if not inside:
            cands = torch.cat([cands[:-1], torch.tensor([gold])])
        scores = logits[m, cands] + selector.successor_codebook[cands] @ query
        label = int((cands == gold).nonzero()[0, 0])
        ce = F.cross_entropy(scores[None], torch.tensor([label]))
        conf.append(float(torch.exp(-ce.detach())) if inside else miss)
        ces.append(ce)
        keep.append(inside or misses == "inject")
    q = torch.zeros(blocks, size)
    supervised = torch.zeros(blocks, size, dtype=torch.bool)
    for m, s in enumerate(targets.select.tolist()):
        q[s // size, s % size], supervised[s // size, s % size] = conf[m], True
    w = direct_weights(q, supervised, alpha).flatten()[targets.select]
    keep = torch.tensor(keep, dtype=torch.float32)
    return (w * keep * torch.stack(ces)).sum(), w * keep


@pytest.mark.parametrize("misses", ["exclude", "inject"])
def test_the_selector_term_uses_its_own_confidences_and_a_miss_counts_zero(misses):
    # 24 rows = 4 blocks of offsets 1..6 (block size 7), half the labels outside the top K.
    hidden, head, bias, targets, selector = selector_case(rows=24)
    size, blocks = 7, 4
    targets = DraftTargets(
        select=torch.tensor([b * size + j for b in range(blocks) for j in range(1, size)]),
        labels=targets.labels,
        weights=targets.weights,
        offsets=torch.arange(24) % 6 + 1,
        predecessors=targets.predecessors,
        teacher_rows=targets.teacher_rows,
    )
    alpha = 0.4
    states = torch.zeros(blocks * size, hidden.shape[1])
    states[targets.select] = hidden
    loss = SelectorLoss(selector, 1.0, misses)
    dpace = PositionWeights("dpace", alpha)
    out = draft_loss(states[None], targets, head, size, 5, bias, loss, dpace)
    ce = F.cross_entropy(hidden @ head.T + bias, targets.labels, reduction="none")
    q = torch.zeros(blocks * size)
    q[targets.select] = torch.exp(-ce)
    unary_w = dpace_weights(torch.exp(-ce), targets.select, blocks, size, alpha)
    sel_sum, sel_w = selector_reference(
        hidden, head, bias, targets, selector, misses, alpha, blocks, size
    )
    want = (unary_w * ce).sum() + sel_sum
    torch.testing.assert_close(out.loss_sum, want.detach(), atol=1e-5, rtol=1e-5)
    per = torch.zeros(size).index_add_(0, targets.offsets, sel_w)
    torch.testing.assert_close(out.selector[3], per, atol=1e-5, rtol=1e-5)

    # The rule can fail: a miss counted as confidence 1 (Automodel's bug) gives the later
    # positions other weights.
    _, bug_w = selector_reference(
        hidden, head, bias, targets, selector, misses, alpha, blocks, size, miss=1.0
    )
    bug = torch.zeros(size).index_add_(0, targets.offsets, bug_w)
    assert not torch.allclose(out.selector[3], bug, atol=1e-3)
