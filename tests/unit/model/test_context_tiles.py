"""The long-row context kernel (`model/context_tiles.py`) against the dense kernel, in float64,
on every layout a drafter gives it: 1, 2 and 4 query heads per key/value head (one: the MHA
drafters of MLA targets such as DeepSeek-V3/R1 and Kimi K2, and of OLMo 2), one and two rows,
full and sliding-window layers, bidirectional and causal blocks, and an output gradient that
arrives contiguous or strided (the drafter reads the output as (batch, rows, heads, d), so its
gradient comes back transposed)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dflash_train.model.block_attention as ba
from dflash_train.model import context_tiles
from dflash_train.model.block_attention import block_attention
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.objective import make_layout, pack_anchors
from pipeline_helpers import record_context_tiles

KV_HEADS, HEAD_DIM, BLOCK, CONTEXT = 2, 8, 4, 40
ROWS = [np.array([0, 5, 9, 20, 30, 37]), np.array([1, 3, 7])]  # row 1 ends in padding blocks


def _kernel_inputs(heads_per_kv: int, batch: int, num_chunks: int, strided: bool):
    """(q, k_ctx, v_ctx, k_blk, v_blk), the layout and the output gradient, float64."""
    gen = torch.Generator().manual_seed(heads_per_kv * 10 + batch)
    n = len(ROWS[0])
    anchors, valid = pack_anchors(ROWS[:batch], n)
    layout = make_layout(anchors, valid, BLOCK, "cpu", num_chunks=num_chunks)
    heads, rows = KV_HEADS * heads_per_kv, n * BLOCK
    shapes = [(batch, heads, rows, HEAD_DIM)] + [(batch, KV_HEADS, CONTEXT, HEAD_DIM)] * 2
    shapes += [(batch, KV_HEADS, rows, HEAD_DIM)] * 2
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    if strided:  # as the output projection hands it back: (batch, rows, heads, d) transposed
        grad = torch.randn(batch, rows, heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        grad = grad.transpose(1, 2)
    else:
        grad = torch.randn(shapes[0], generator=gen, dtype=torch.float64)
    return inputs, layout, grad


def _run(backend, inputs, layout, grad, window, causal) -> list[torch.Tensor]:
    xs = [t.clone().requires_grad_() for t in inputs]
    out = block_attention(*xs, layout, backend, window, causal)
    out.backward(grad)
    return [out.detach(), *(x.grad for x in xs)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous-grad", "strided-grad"])
@pytest.mark.parametrize(("window", "causal"), list(itertools.product([None, 5], [False, True])))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 4])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_the_tiled_context_kernel_equals_dense_in_float64_for_every_head_layout(
    num_chunks, heads_per_kv, batch, window, causal, strided, monkeypatch
):
    tiles = record_context_tiles(monkeypatch)
    monkeypatch.setattr(ba, "context_tile", lambda rows, s: 7)  # 7 context keys a tile
    inputs, layout, grad = _kernel_inputs(heads_per_kv, batch, num_chunks, strided)
    assert grad.is_contiguous() != strided
    dense = _run("dense", inputs, layout, grad, window, causal)
    tiled = _run("blockwise", inputs, layout, grad, window, causal)
    assert tiles and set(tiles) == {7}
    names = ["out", "q", "k_ctx", "v_ctx", "k_blk", "v_blk"]
    for name, got, want in zip(names, tiled, dense, strict=True):
        # float64 throughout (softmax statistics included): only rounding separates the two.
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("heads_per_kv", [1, 2])
def test_the_one_pass_chunk_kernel_equals_dense_in_float64(heads_per_kv):
    # Below the score budget the chunk kernel saves its probabilities: same layouts, no tiles.
    inputs, layout, grad = _kernel_inputs(heads_per_kv, 1, 3, strided=True)
    dense = _run("dense", inputs, layout, grad, None, False)
    one_pass = _run("blockwise", inputs, layout, grad, None, False)
    for got, want in zip(one_pass, dense, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def _mha_drafter() -> DFlashDraftModel:
    """A drafter with one query head per key/value head, as an MLA target's is."""
    config = DFlashConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, vocab_size=64, num_target_layers=6,
        target_layer_ids=[1, 3], mask_token_id=63, block_size=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    return DFlashDraftModel(config)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_drafter_with_one_query_head_per_kv_head_trains_through_the_tiled_context(
    batch, monkeypatch
):
    """One micro-step (forward, LM-head loss, backward) of an MHA drafter over a context long
    enough for `context_tile` to tile it (its budget lowered so that 300 tokens are long), with
    the parameters' gradients equal to the dense kernel's."""
    tiles = record_context_tiles(monkeypatch)
    monkeypatch.setattr(context_tiles, "CONTEXT_SCORES_BYTES", 64 * 1024)
    model = _mha_drafter()
    gen = torch.Generator().manual_seed(batch)
    seq, blocks = 300, 12
    features = torch.randn(batch, seq, 64, generator=gen)
    row = np.sort(np.random.default_rng(batch).choice(seq - 4, blocks, replace=False)) + 1
    rows = [row] * batch
    anchors, valid = pack_anchors(rows, blocks)
    layout = make_layout(anchors, valid, 4, "cpu", num_chunks=2)
    embeds = torch.randn(batch, blocks * 4, 32, generator=gen)
    head = torch.randn(64, 32, generator=gen)
    labels = torch.randint(0, 64, (batch * blocks * 4,), generator=gen)
    grads = {}
    for backend in ("dense", "blockwise"):
        model.zero_grad()
        hidden = model(embeds, features, layout, backend)
        F.cross_entropy(hidden.reshape(-1, 32) @ head.T, labels).backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert tiles and min(tiles) >= 128  # the real tile rule: at least 128 keys a tile
    for name, want in grads["dense"].items():
        torch.testing.assert_close(grads["blockwise"][name], want, atol=1e-5, rtol=1e-4, msg=name)
