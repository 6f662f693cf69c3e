"""The objective: anchors, labels without shift, decay weights, padding, the chunked loss."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_train.model.dflash2 import CandidateSelector
from dflash_train.objective import (
    DraftTargets,
    SelectorLoss,
    acceptance_estimate,
    block_targets,
    block_token_ids,
    decay_weights,
    default_gamma,
    draft_loss,
    fused_linear_cross_entropy,
    loss_gamma,
    pack_anchors,
    round_up_pow2,
    sample_anchors,
    selector_estimates,
    valid_anchor_positions,
)


def test_default_gamma_by_block_size_and_an_explicit_gamma_wins():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert loss_gamma(16) == 7.0 and loss_gamma(16, 3.5) == 3.5


def test_valid_anchors_need_two_consecutive_supervised_tokens():
    mask = np.array([0, 1, 1, 0, 1, 0, 1, 1, 1])
    assert valid_anchor_positions(mask).tolist() == [1, 6, 7]


def test_sampled_anchors_are_distinct_sorted_valid_and_capped():
    rng = np.random.default_rng(0)
    mask = np.ones(200, dtype=np.uint8)
    mask[:50] = 0
    a = sample_anchors(mask, 64, rng)
    assert len(a) == 64 and len(set(a.tolist())) == 64
    assert np.all(np.diff(a) > 0) and a.min() >= 50 and a.max() <= 198
    assert sample_anchors(np.zeros(10, np.uint8), 8, rng).size == 0


def test_anchor_sampling_is_uniform_over_the_valid_positions():
    rng = np.random.default_rng(1)
    mask = np.ones(40, dtype=np.uint8)
    counts = np.zeros(40)
    for _ in range(2000):
        counts[sample_anchors(mask, 5, rng)] += 1
    hits = counts[:39]  # 39 valid positions, each drawn with probability 5/39
    assert counts[39] == 0
    assert np.abs(hits / 2000 - 5 / 39).max() < 0.04


def test_round_up_pow2_gives_few_shapes():
    assert [round_up_pow2(n) for n in (0, 1, 16, 17, 100, 512)] == [16, 16, 16, 32, 128, 512]


def test_decay_weights_start_at_one_on_offset_one():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1.0
    assert math.isclose(float(w[8]), math.exp(-7 / 7.0), rel_tol=1e-6)


def test_block_inputs_are_anchor_then_masks():
    ids = torch.arange(100, 130)[None]
    anchors = torch.tensor([[3, 10]])
    blocks = block_token_ids(ids, anchors, 4, mask_token_id=7)
    assert blocks.tolist() == [[103, 7, 7, 7, 110, 7, 7, 7]]


def test_labels_are_not_shifted_and_offset_zero_is_unsupervised():
    length, bs = 30, 4
    ids = torch.arange(1000, 1000 + length)[None]
    mask = torch.ones(1, length, dtype=torch.uint8)
    anchors, valid = pack_anchors([np.array([2, 5, 20])], 4)
    t = block_targets(ids, mask, anchors, valid, bs, gamma=4.0)
    blocks, offs = t.select // bs, t.select % bs
    expected = 1000 + anchors[0, blocks] + offs  # offset k predicts x[p + k]
    assert torch.equal(t.labels, expected)
    assert torch.equal(t.offsets, offs)
    assert (offs >= 1).all()  # the anchor itself is never a label
    assert not (blocks == 3).any()  # the padding block carries nothing
    assert len(t.select) == 3 * (bs - 1)


def test_weights_follow_decay_mask_and_sequence_end():
    length, bs = 12, 4
    ids = torch.arange(length)[None]
    mask = torch.ones(1, length, dtype=torch.uint8)
    mask[0, 4] = 0  # an unsupervised token inside block 0: the block ends there
    anchors, valid = pack_anchors([np.array([2, 9])], 2)
    t = block_targets(ids, mask, anchors, valid, bs, gamma=4.0)
    got = {int(s): float(w) for s, w in zip(t.select, t.weights, strict=True)}
    w = decay_weights(bs, 4.0)
    want = {1: float(w[1]), 5: float(w[1]), 6: float(w[2])}
    assert got == pytest.approx(want)  # 4 masked and 5 after it; 12 is off the end


def test_a_block_never_reaches_into_the_next_answer_of_a_multi_turn_row():
    """Regression: an anchor near the end of answer 1 was trained on answer 2's first tokens,
    across a short user turn the drafter never sees (served, the draft stops at the turn's
    end). The labels end at the first unsupervised position."""
    bs = 16
    mask = torch.tensor([[0] * 4 + [1] * 10 + [0] * 3 + [1] * 13], dtype=torch.uint8)
    ids = torch.arange(mask.shape[1])[None]
    anchors, valid = pack_anchors([np.array([10, 17])], 2)
    t = block_targets(ids, mask, anchors, valid, bs, gamma=7.0)
    blocks, labels = t.select // bs, t.labels
    assert labels[blocks == 0].tolist() == [11, 12, 13]  # answer 1's end, not 17..25
    assert labels[blocks == 1].tolist() == list(range(18, 30))


def test_targets_split_by_anchor_chunk_index_each_chunks_own_rows():
    gen = torch.Generator().manual_seed(3)
    batch, length, n, bs = 3, 40, 5, 4
    ids = torch.randint(0, 50, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).to(torch.uint8)
    anchors, valid = pack_anchors(
        [np.array([1, 9, 20, 30, 37]), np.array([4, 12]), np.array([])], n
    )
    t = block_targets(ids, mask, anchors, valid, bs, gamma=4.0)
    chunks = [(0, 2, 0), (2, 3, 0), (3, 5, 0)]
    parts = t.split_by_chunks(n, bs, chunks)
    assert sum(len(p) for p in parts) == len(t)
    # Every position keeps its label, weight and offset, at its place in the chunk's own rows.
    flat = torch.arange(batch * n * bs).view(batch, n * bs)
    rebuilt = []
    for (lo, hi, _), part in zip(chunks, parts, strict=True):
        chunk_rows = flat[:, lo * bs : hi * bs].flatten()
        rebuilt.append(torch.stack([chunk_rows[part.select], part.labels, part.offsets], 1))
        assert torch.all((part.select >= 0) & (part.select < batch * (hi - lo) * bs))
    rebuilt = torch.cat(rebuilt)
    order = rebuilt[:, 0].argsort()
    assert torch.equal(rebuilt[order, 0], t.select)
    assert torch.equal(rebuilt[order, 1], t.labels)
    assert torch.equal(rebuilt[order, 2], t.offsets)
    assert torch.equal(torch.cat([p.weights for p in parts])[order], t.weights)
    assert len(parts[1]) > 0 and len(parts[2]) > 0  # chunk 2 of row 1 is padding only


def test_fused_loss_equals_unchunked_cross_entropy_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    w = torch.rand(37)
    ref = (F.cross_entropy(hidden @ head.T, labels, reduction="none") * w).sum()
    (g_ref,) = torch.autograd.grad(ref, hidden)
    for chunk in (1, 5, 37, 100):
        loss, correct = fused_linear_cross_entropy(hidden, head, labels, w, chunk)
        (g,) = torch.autograd.grad(loss * 0.5, hidden)
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, 0.5 * g_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(correct, (hidden @ head.T).argmax(-1) == labels)


def test_a_batch_without_valid_anchors_gives_a_zero_weight_step():
    ids = torch.arange(20)[None]
    anchors, valid = pack_anchors([np.zeros(0, dtype=np.int64)], 16)
    t = block_targets(ids, torch.zeros(1, 20, dtype=torch.uint8), anchors, valid, 4, 4.0)
    hidden = torch.randn(1, 64, 8, requires_grad=True)
    out = draft_loss(hidden, t, torch.randn(30, 8), 4, chunk_rows=16)
    out.loss_sum.backward()
    assert out.loss_sum.detach().item() == 0.0 and t.weights.sum().item() == 0.0
    assert torch.all(hidden.grad == 0)


def test_acceptance_estimate_is_one_plus_sum_of_prefix_products():
    correct = torch.tensor([0.0, 8, 4, 0])
    count = torch.tensor([0.0, 10, 8, 0])
    acc, tau = acceptance_estimate(correct, count)
    assert acc == pytest.approx([0.8, 0.5, 0.0])
    assert tau == pytest.approx(1 + 0.8 + 0.4)


# ----------------------------------------------------------------------------- DFlash 2
def test_targets_carry_the_previous_gold_token_as_predecessor():
    ids = torch.arange(500, 530)[None]
    anchors, valid = pack_anchors([np.array([2, 5, 20])], 3)
    t = block_targets(ids, torch.ones(1, 30, dtype=torch.uint8), anchors, valid, 4, 4.0)
    assert torch.equal(t.predecessors, t.labels - 1)  # x[p + k - 1]; the anchor for k = 1
    first = t.offsets == 1
    assert torch.equal(t.predecessors[first], 500 + anchors[0])
    parts = t.split_by_chunks(3, 4, [(0, 1, 0), (1, 3, 0)])
    assert torch.equal(torch.cat([p.predecessors for p in parts]), t.predecessors)


def selector_case(seed: int = 0, rows: int = 23, vocab: int = 40, top_k: int = 5):
    """Random rows, a frozen head (with bias), labels of which some are outside the top K,
    and a selector with every codebook random (not at its initial values)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 12, generator=gen)
    head, bias = torch.randn(vocab, 12, generator=gen), torch.randn(vocab, generator=gen)
    logits = hidden @ head.T + bias
    # Half the labels from the top 3 (inside the top K), half anywhere (often outside).
    top = logits.topk(3).indices[torch.arange(rows), torch.randint(0, 3, (rows,), generator=gen)]
    labels = torch.where(
        torch.arange(rows) % 2 == 0, top, torch.randint(0, vocab, (rows,), generator=gen)
    )
    torch.manual_seed(seed)
    selector = CandidateSelector(12, vocab, rank=6, top_k=top_k)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_(0.0, 0.5)
    offsets = 1 + torch.arange(rows) % 3
    targets = DraftTargets(
        select=torch.arange(rows),
        labels=labels,
        weights=torch.rand(rows, generator=gen),
        offsets=offsets,
        predecessors=torch.randint(0, vocab, (rows,), generator=gen),
        teacher_rows=torch.arange(rows),
    )
    return hidden, head, bias, targets, selector


def naive_selector_loss(hidden, head, bias, targets, selector, misses):
    """The selector term from dense logits, one row at a time."""
    logits = hidden @ head.T + bias
    k = selector.top_k
    total = torch.zeros(())
    correct = []
    for m in range(hidden.shape[0]):
        cands = logits[m].topk(k).indices
        gold = int(targets.labels[m])
        query = (
            selector.hidden_projection(hidden[m])
            * selector.predecessor_codebook[targets.predecessors[m]]
        )
        scores = logits[m, cands] + selector.successor_codebook[cands] @ query
        inside = bool((cands == gold).any())
        correct.append(inside and int(cands[scores.argmax()]) == gold)
        if not inside and misses == "exclude":
            continue
        if not inside:  # the gold replaces the weakest candidate
            cands = torch.cat([cands[:-1], torch.tensor([gold])])
            scores = logits[m, cands] + selector.successor_codebook[cands] @ query
        label = int((cands == gold).nonzero()[0, 0])
        total = total + targets.weights[m] * F.cross_entropy(scores[None], torch.tensor([label]))
    return total, torch.tensor(correct)


@pytest.mark.parametrize("misses", ["exclude", "inject"])
@pytest.mark.parametrize("backbone_grad", [True, False])
@pytest.mark.parametrize("uniform", [None, 0.37])
def test_the_selector_term_equals_its_definition_with_gradients(misses, backbone_grad, uniform):
    hidden, head, bias, targets, selector = selector_case()
    rows = hidden.clone().requires_grad_()
    unary = (
        F.cross_entropy(rows @ head.T + bias, targets.labels, reduction="none") * targets.weights
    ).sum()
    sel_targets = targets  # uniform: every supervised position weighs `uniform` in the term
    if uniform is not None:
        assert len(set(targets.weights[targets.weights > 0].tolist())) > 1  # decayed differ
        flat = (targets.weights > 0).float() * uniform
        sel_targets = dataclasses.replace(targets, weights=flat)
    term, correct = naive_selector_loss(
        rows if backbone_grad else rows.detach(), head, bias, sel_targets, selector, misses
    )
    params = list(selector.parameters())
    want = torch.autograd.grad(unary + 0.7 * term, [rows, *params])
    in_top = ((hidden @ head.T + bias).topk(selector.top_k).indices == targets.labels[:, None]).any(
        1
    )
    assert 0 < int(in_top.sum()) < len(in_top)  # both cases occur
    x = hidden.clone().requires_grad_()
    loss = SelectorLoss(selector, 0.7, misses, backbone_grad, uniform)
    out = draft_loss(x[None], targets, head, 4, chunk_rows=5, head_bias=bias, selector=loss)
    got = torch.autograd.grad(out.loss_sum, [x, *params])
    torch.testing.assert_close(out.loss_sum, (unary + 0.7 * term).detach(), atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    # Per offset: top-K recall, teacher-forced selector hits, the unscaled selector sum.
    per = lambda v: torch.zeros(4).index_add_(0, targets.offsets, v.float())  # noqa: E731
    assert torch.equal(out.selector[0], per(in_top))
    assert torch.equal(out.selector[1], per(correct))
    torch.testing.assert_close(out.selector[2].sum(), term.detach(), atol=1e-5, rtol=1e-5)


def test_without_backbone_gradient_the_rows_get_the_unary_gradient_only():
    hidden, head, bias, targets, selector = selector_case(seed=1)
    grads = []
    for sel in (None, SelectorLoss(selector, backbone_grad=False)):
        x = hidden.clone().requires_grad_()
        out = draft_loss(x[None], targets, head, 4, chunk_rows=7, head_bias=bias, selector=sel)
        grads.append(torch.autograd.grad(out.loss_sum, x)[0])
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)
    assert selector.successor_codebook.grad is None  # autograd.grad above, not .backward


def test_the_selector_loss_never_keeps_full_vocabulary_logits():
    # 64 rows x 4096 tokens: the fused loss may hold one chunk of logits at a time (16 rows)
    # and never save a rows x vocabulary tensor for backward.
    hidden, head, bias, targets, selector = selector_case(seed=2, rows=64, vocab=4096)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    x = hidden.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = draft_loss(
            x[None],
            targets,
            head,
            4,
            chunk_rows=16,
            head_bias=bias,
            selector=SelectorLoss(selector),
        )
    out.loss_sum.backward()
    head_numel = head.numel()  # the frozen head itself is saved by reference, never copied
    assert max(n for n in saved if n != head_numel) < 64 * 4096 // 8, sorted(saved)[-4:]


def test_selector_estimates_use_the_selector_path_and_report_recall():
    count = torch.tensor([0.0, 10, 10, 10])
    selector = torch.tensor([[0.0, 10, 9, 5], [0.0, 9, 6, 3], [0.0, 2.0, 3.0, 4.0]])
    recall, acc, tau, total = selector_estimates(selector, count)
    assert recall == pytest.approx([1.0, 0.9, 0.5]) and acc == pytest.approx([0.9, 0.6, 0.3])
    assert tau == pytest.approx(1 + 0.9 + 0.54 + 0.162) and total == pytest.approx(9.0)


def test_the_uniform_selector_weight_keeps_a_full_blocks_total():
    from dflash_train.objective import uniform_position_weight

    w = uniform_position_weight(16, 7.0)
    assert w * 15 == pytest.approx(float(decay_weights(16, 7.0).sum()))
    assert 0 < w < 1
