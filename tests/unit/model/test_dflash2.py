"""DFlash 2's modules: the convolution's formula and block boundaries, identity initialisation,
the selector's scoring and walk, train = inference with both on, the config's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_draft import check_cached_matches_training, check_chunks_alone, small_config

from dflash_train.model.dflash2 import CandidateSelector, GroupedDynamicConv
from dflash_train.model.draft import DFlashDraftModel, DraftCache
from dflash_train.objective import block_token_ids, make_layout, pack_anchors

DFLASH2 = dict(arch="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)


def dflash2_model(seed: int = 0, **kw) -> DFlashDraftModel:
    """A DFlash 2 drafter whose modules are NOT at their initial values (random taps,
    projections and codebooks), so every test below can see them act."""
    torch.manual_seed(seed)
    model = DFlashDraftModel(small_config(**{**DFLASH2, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                p.normal_(0.0, 0.3)
    return model


def naive_convolve(x, base, delta, block_len, group_size):
    """out[t, c] = sum_tau (base[tau, c] + delta[t, tau, c // g]) * x[t - tau, c], with taps
    reading zero before the start of t's block. x: (L, D), base: (T, D), delta: (L, T, G)."""
    length, dim = x.shape
    out = torch.zeros_like(x)
    for t in range(length):
        for tau in range(base.shape[0]):
            if t % block_len < tau:
                continue
            for c in range(dim):
                out[t, c] += (base[tau, c] + delta[t, tau, c // group_size]) * x[t - tau, c]
    return out


@pytest.mark.parametrize(("kernel_size", "block_len"), [(2, 4), (3, 4), (3, 2)])
def test_prepare_and_finish_follow_the_formula_block_by_block(kernel_size, block_len):
    torch.manual_seed(0)
    conv = GroupedDynamicConv(16, kernel_size, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    h, z = torch.randn(2, 3 * block_len, 16), torch.randn(2, 3 * block_len, 16)
    with torch.no_grad():
        out, kernel = conv.prepare(h, block_len)
        finished = conv.finish(z, kernel, block_len)
        delta = conv.kernel_projection(h).view(2, 3 * block_len, 2, kernel_size, 4)
    for b in range(2):
        want = naive_convolve(h[b], conv.base_kernel[0], delta[b, :, 0], block_len, 4)
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
        # finish: base[1] on z, with the kernel computed from prepare's input (not from z)
        want = naive_convolve(z[b], conv.base_kernel[1], delta[b, :, 1], block_len, 4)
        torch.testing.assert_close(finished[b], want, atol=1e-5, rtol=1e-5)


def test_taps_never_cross_a_block_boundary():
    torch.manual_seed(1)
    conv = GroupedDynamicConv(16, 2, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        h = torch.randn(1, 12, 16)
        base, _ = conv.prepare(h, 4)
        poked = h.clone()
        poked[0, 7] += 5.0  # the last position of block 1
        out, _ = conv.prepare(poked, 4)
    changed = (out - base).abs().amax(-1)[0]
    assert changed[7] > 1e-3
    assert torch.all(changed[8:] < 1e-6)  # block 2's first position reads zero, not position 7
    assert torch.all(changed[:7] < 1e-6)  # taps only look back
    with torch.no_grad():
        poked = h.clone()
        poked[0, 5] += 5.0
        out, _ = conv.prepare(poked, 4)
    assert (out - base).abs().amax(-1)[0, 6] > 1e-3  # ... but do look back inside a block


def test_the_identity_initialisation_survives_init_weights():
    model = DFlashDraftModel(small_config(**DFLASH2))
    model.init_weights(std=0.5, seed=3)  # the generic rule re-draws every other Linear
    h = torch.randn(2, 8, 32)
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(
                conv.kernel_projection.weight, torch.zeros_like(conv.kernel_projection.weight)
            )
            with torch.no_grad():
                out, kernel = conv.prepare(h, 4)
                assert torch.equal(out, h) and torch.equal(conv.finish(h, kernel, 4), h)
    sel = model.candidate_selector
    assert torch.equal(sel.successor_codebook, torch.zeros_like(sel.successor_codebook))
    assert sel.predecessor_codebook.std() > 0.01 and sel.hidden_projection.weight.std() > 0.01


def test_at_initialisation_the_selector_ranks_as_the_unary_logits():
    sel = CandidateSelector(32, 64, rank=8, top_k=5)
    gen = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(6, 32, generator=gen), torch.randn(6, 64, generator=gen)
    pair = sel.pair_scores(hidden, torch.randint(0, 64, (6,)), torch.randint(0, 64, (6, 5)))
    assert torch.equal(pair, torch.zeros_like(pair))
    tokens, candidates, q = sel.walk(hidden, logits, torch.tensor(3))
    assert torch.equal(tokens, logits.argmax(-1)) and q is None
    assert torch.equal(candidates.sort(-1).values, logits.topk(5).indices.sort(-1).values)


def naive_walk(sel, hidden, logits, anchor):
    """The selector's greedy walk written out: score every top-K candidate given the token
    chosen before it (the anchor first)."""
    tokens, prev = [], anchor
    for t in range(hidden.shape[0]):
        best, best_score = None, -float("inf")
        for b in logits[t].topk(sel.top_k).indices.tolist():
            pair = sel.predecessor_codebook[prev] * sel.hidden_projection(hidden[t])
            score = float(logits[t, b] + (pair * sel.successor_codebook[b]).sum())
            if score > best_score:
                best, best_score = b, score
        tokens.append(best)
        prev = best
    return tokens


def test_the_greedy_walk_feeds_each_choice_to_the_next_position():
    model = dflash2_model(seed=2)
    sel = model.candidate_selector
    gen = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(7, 32, generator=gen), 0.3 * torch.randn(7, 64, generator=gen)
    with torch.no_grad():
        tokens, _, _ = sel.walk(hidden, logits, torch.tensor(9))
        want = naive_walk(sel, hidden, logits, 9)
    assert tokens.tolist() == want
    assert tokens.tolist() != logits.argmax(-1).tolist()  # the pair term changed some choice


def test_the_sampled_walk_draws_from_the_softmax_of_the_scores():
    model = dflash2_model(seed=3)
    sel = model.candidate_selector
    gen = torch.Generator().manual_seed(2)
    hidden, logits = torch.randn(1, 32, generator=gen), torch.randn(1, 64, generator=gen)
    with torch.no_grad():
        _, candidates, q = sel.walk(hidden, logits, torch.tensor(4), temperature=0.7)
        pair = sel.pair_scores(hidden, torch.tensor([4]), candidates)
    want = torch.softmax((logits.gather(1, candidates) + pair) / 0.7, -1)
    torch.testing.assert_close(q, want, atol=1e-6, rtol=1e-5)
    draws = torch.zeros(4)
    g = torch.Generator().manual_seed(0)
    for _ in range(4000):
        tok, cand, _ = sel.walk(hidden, logits, torch.tensor(4), 0.7, g)
        draws[(cand[0] == tok[0]).nonzero()[0, 0]] += 1
    assert (draws / draws.sum() - q[0]).abs().max() < 0.03


# ----------------------------------------------------------------------------- train = inference
def close_inputs(seq: int = 24, bs: int = 4):
    """Anchors closer than the block size (1, 2, 3 and 9, 10) and blocks running past the end
    of the sequence (21, 22): the convolution may read neither a neighbour block nor beyond."""
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(2, seq, 64, generator=gen)
    embed = torch.randn(64, 32, generator=gen)
    ids = torch.randint(0, 60, (2, seq), generator=gen)
    anchors, valid = pack_anchors([np.array([1, 2, 3, 21, 22]), np.array([9, 10, 22])], 5)
    layout = make_layout(anchors, valid, bs, "cpu", num_chunks=2)
    return features, embed[block_token_ids(ids, anchors, bs, 63)], layout


@pytest.mark.parametrize("backend", ["dense", "blockwise"])
def test_cached_inference_matches_training_with_convolutions_and_close_anchors(backend):
    model = dflash2_model(seed=4)
    sel = model.candidate_selector
    features, embeds, layout = close_inputs()
    bs = layout.block_size
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(64, 32, generator=gen)  # a stand-in LM head for the selector's logits
    with torch.no_grad():
        train_out = model(embeds, features, layout, backend)
        for row in range(2):
            for j in range(int(layout.valid[row].sum())):
                p = int(layout.anchors[row, j])
                block = slice(j * bs, (j + 1) * bs)
                cache = DraftCache(len(model.layers))
                one = embeds[row : row + 1, block]
                out = model.forward_cached(one, features[row : row + 1, :p], p, cache)[0]
                torch.testing.assert_close(out, train_out[row, block], atol=1e-5, rtol=1e-5)
                # The selector reads these states: the same teacher-forced scores, the same walk.
                served, trained = out[1:], train_out[row, block][1:]
                prev = torch.randint(0, 64, (bs - 1,), generator=gen)
                cands = (trained @ head.T).topk(4).indices
                torch.testing.assert_close(
                    sel.pair_scores(served, prev, cands),
                    sel.pair_scores(trained, prev, cands),
                    atol=1e-5,
                    rtol=1e-5,
                )
                anchor = torch.tensor(5)
                walks = [sel.walk(h, h @ head.T, anchor)[0] for h in (served, trained)]
                assert torch.equal(*walks)


def test_the_convolutions_change_the_forward_so_parity_is_not_trivial():
    features, embeds, layout = close_inputs()
    model = dflash2_model(seed=4)
    plain = DFlashDraftModel(small_config())
    plain.load_state_dict(
        {k: v for k, v in model.state_dict().items() if "_conv." not in k and "selector" not in k}
    )
    with torch.no_grad():
        diff = (
            (model(embeds, features, layout, "dense") - plain(embeds, features, layout, "dense"))
            .abs()
            .max()
        )
    assert diff > 1e-2


@pytest.mark.parametrize("name", ["full", "sliding"])
def test_cached_inference_matches_training_with_dflash2(name):
    kw = (
        {}
        if name == "full"
        else dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    )
    check_cached_matches_training(dflash2_model(seed=5, **kw), 12, "blockwise")


@pytest.mark.parametrize("backend", ["dense", "blockwise", "flex"])
def test_an_anchor_chunk_alone_gives_the_whole_forwards_rows_with_dflash2(backend):
    check_chunks_alone(dflash2_model(seed=6), 13, backend)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"conv_group_size": 7}, "conv_group_size 7 does not divide hidden_size 32"),
        ({"selector_top_k": 65}, "selector_top_k 65 is larger than the vocabulary (64 tokens)"),
        ({"selector_rank": 0}, "selector_rank must be >= 1"),
        ({"arch": "dflash3"}, "arch must be one of"),
    ],
)
def test_bad_dflash2_configs_name_the_problem(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        small_config(**{**DFLASH2, **kw})


def test_dflash1_configs_carry_no_dflash2_fields_and_old_ones_load_as_dflash1():
    config = small_config()
    assert config.arch == "dflash" and config.selector_top_k is None
    assert not any("conv" in k or "selector" in k for k in DFlashDraftModel(config).state_dict())
    with pytest.raises(ValueError, match="are DFlash 2 fields"):
        small_config(selector_top_k=4)
    defaults = DFlashDraftModel(small_config(arch="dflash2", conv_group_size=8)).config
    assert (defaults.conv_kernel_size, defaults.selector_rank, defaults.selector_top_k) == (
        2,
        256,
        16,
    )


def test_init_from_refuses_a_source_whose_layers_attend_otherwise(tmp_path):
    """Regression: --init-from compared the backbone's shapes only, so a DFlash 1 drafter with
    causal sliding layers warm-started a DFlash 2 one (bidirectional by its contract) and
    every layer silently saw something else."""
    from dflash_train.export import export_draft
    from dflash_train.model.checkpoint import init_from_draft

    sliding = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    export_draft(DFlashDraftModel(small_config(**sliding)), tmp_path / "d1_sliding")
    target = DFlashDraftModel(small_config(**DFLASH2, **sliding, is_causal=False))
    with pytest.raises(ValueError, match=r"layer 0: sliding 8 causal there, sliding 8 bidir"):
        init_from_draft(target, tmp_path / "d1_sliding")
    # The same layout is accepted: causal where it was causal.
    init_from_draft(DFlashDraftModel(small_config(**DFLASH2, **sliding)), tmp_path / "d1_sliding")
    # All full layers are bidirectional either way: DFlash 1 into DFlash 2 stays possible.
    export_draft(DFlashDraftModel(small_config()), tmp_path / "d1_full")
    full = tmp_path / "d1_full"
    init_from_draft(DFlashDraftModel(small_config(**DFLASH2, is_causal=False)), full)
    with pytest.raises(ValueError, match="layer 1: full bidirectional there, full causal here"):
        init_from_draft(DFlashDraftModel(small_config(is_causal=True)), full)


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
def test_the_served_convolution_runs_a_two_token_block_up_to_kernel_size_3(kernel_size):
    """The boundary of --conv-kernel-size: the reference client's convolution shifts a block by
    each tap with a pad, which breaks when a tap reaches past a block shorter than it (a
    decode's last block can be 2 tokens: 1 anchor + 1 draft). Up to 3 taps it runs and agrees
    with this project's (which clamps); from 4 it fails, so training refuses 4 and above."""
    reference = pytest.importorskip("dflash.model")
    from dflash_train.config import MAX_CONV_KERNEL_SIZE, ModelOptions

    torch.manual_seed(kernel_size)
    conv = GroupedDynamicConv(16, kernel_size, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    h = torch.randn(1, 2, 16)  # one block of 2 positions
    delta = conv.kernel_projection(h).view(1, 2, 2, kernel_size, 4)[..., 0, :, :]
    with torch.no_grad():
        ours, _ = conv.prepare(h, block_len=2)
    served = kernel_size <= MAX_CONV_KERNEL_SIZE
    if served:
        theirs = reference._grouped_dynamic_convolve(h, delta, conv.base_kernel[0], 4)
        torch.testing.assert_close(ours, theirs.detach(), atol=1e-5, rtol=1e-5)
        ModelOptions(arch="dflash2", conv_kernel_size=kernel_size)
        return
    with pytest.raises(RuntimeError):
        reference._grouped_dynamic_convolve(h, delta, conv.base_kernel[0], 4)
    with pytest.raises(ValueError, match="conv_kernel_size must be <= 3"):
        ModelOptions(arch="dflash2", conv_kernel_size=kernel_size)
