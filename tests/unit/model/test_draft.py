"""The draft model: layer-id rule, config validation, masks that cannot leak, train/infer parity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.model.block_attention import block_attention
from dflash_train.model.draft import (
    DFlashConfig,
    DFlashDraftModel,
    DraftCache,
    default_target_layer_ids,
)
from dflash_train.objective import block_token_ids, make_layout, pack_anchors

BACKENDS = ["dense", "blockwise", "flex"]


def small_config(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=63,
        block_size=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    base.update(kw)
    return DFlashConfig(**base)


def test_default_layer_ids_follow_the_paper_rule():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"target_layer_ids": [1, 6]}, "out of range"),
        # Served in layer order, each once (vLLM, SGLang): another order permutes fc's inputs.
        ({"target_layer_ids": [3, 1]}, r"\[3, 1\] must be ascending: .*use \[1, 3\]"),
        ({"mask_token_id": 64}, "mask_token_id 64"),
        ({"block_size": 1}, "block_size"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_bad_configs_name_the_problem(kw, needle):
    with pytest.raises(ValueError, match=needle):
        small_config(**kw)


def test_features_of_the_wrong_width_are_refused():
    model = DFlashDraftModel(small_config())
    with pytest.raises(ValueError, match="width"):
        model.fuse_context(torch.zeros(1, 5, 48))


def test_features_reach_fc_in_their_own_dtype_under_autocast_and_cast_without_it():
    # Under autocast fc runs in autocast's dtype and casts its input itself: a cast to the fp32
    # weights first would be a (batch, S, K * hidden) fp32 copy thrown away at once.
    model = DFlashDraftModel(small_config())
    seen = []
    model.fc.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    features = torch.randn(1, 5, 64).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.fuse_context(features)
    assert seen == [torch.bfloat16] and out.dtype in (torch.bfloat16, torch.float32)
    with torch.no_grad():
        model.fuse_context(features)  # fp32 weights, no autocast: the cast is needed
    assert seen[1] == torch.float32


def _inputs(seed=0, batch=2, seq=24, blocks=4, bs=4):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, seq, 64, generator=gen)
    embed = torch.randn(64, 32, generator=gen)
    ids = torch.randint(0, 60, (batch, seq), generator=gen)
    rng = np.random.default_rng(seed)
    rows = [
        np.sort(rng.choice(np.arange(1, seq - 1), size=blocks - i, replace=False))
        for i in range(batch)
    ]
    anchors, valid = pack_anchors(rows, blocks)
    layout = make_layout(anchors, valid, bs, "cpu", num_chunks=2)
    block_embeds = embed[block_token_ids(ids, anchors, bs, 63)]
    return features, block_embeds, layout


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_at_or_after_the_anchor_is_invisible(backend):
    torch.manual_seed(0)
    model = DFlashDraftModel(small_config())
    features, embeds, layout = _inputs()
    with torch.no_grad():
        base = model(embeds, features, layout, backend)
        row, j = 0, 1
        p = int(layout.anchors[row, j])
        bs = layout.block_size
        block = slice(j * bs, (j + 1) * bs)
        # Perturbing the anchor's own feature (and everything after it) must not move block j.
        later = features.clone()
        later[row, p:] += 5.0
        out = model(embeds, later, layout, backend)
        torch.testing.assert_close(out[row, block], base[row, block], atol=1e-5, rtol=0)
        # ... while the position just before the anchor must.
        before = features.clone()
        before[row, p - 1] += 5.0
        out = model(embeds, before, layout, backend)
        assert (out[row, block] - base[row, block]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_do_not_see_each_other(backend):
    torch.manual_seed(0)
    model = DFlashDraftModel(small_config())
    features, embeds, layout = _inputs()
    bs = layout.block_size
    with torch.no_grad():
        base = model(embeds, features, layout, backend)
        poked = embeds.clone()
        poked[0, 2 * bs : 3 * bs] += 3.0  # block 2 of row 0
        out = model(poked, features, layout, backend)
    changed = (out - base).abs().amax(-1)[0].view(-1, bs).amax(-1)
    assert changed[2] > 1e-3
    assert torch.all(changed[[0, 1, 3]] < 1e-5)


def test_all_backends_agree_forward():
    torch.manual_seed(0)
    model = DFlashDraftModel(small_config())
    features, embeds, layout = _inputs(seed=3)
    with torch.no_grad():
        outs = {b: model(embeds, features, layout, b) for b in BACKENDS}
    for b in ("blockwise", "flex"):
        torch.testing.assert_close(outs[b], outs["dense"], atol=1e-5, rtol=1e-5)


def test_dense_and_blockwise_agree_on_gradients():
    torch.manual_seed(0)
    model = DFlashDraftModel(small_config())
    features, embeds, layout = _inputs(seed=4)
    weights = torch.randn((*embeds.shape[:2], 32))
    grads = {}
    for b in ("dense", "blockwise"):
        model.zero_grad()
        (model(embeds, features, layout, b) * weights).sum().backward()
        grads[b] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["dense"].items():
        torch.testing.assert_close(grads["blockwise"][name], g, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["dense", "blockwise"])
def test_cached_inference_matches_training_forward(backend):
    torch.manual_seed(0)
    check_cached_matches_training(DFlashDraftModel(small_config()), 5, backend)


def check_cached_matches_training(model: DFlashDraftModel, seed: int, backend: str) -> None:
    """Every block of row 0 through the cached inference path equals the training forward."""
    features, embeds, layout = _inputs(seed=seed)
    bs = layout.block_size
    with torch.no_grad():
        train_out = model(embeds, features, layout, backend)
        for j in range(layout.num_blocks):
            p = int(layout.anchors[0, j])
            block = slice(j * bs, (j + 1) * bs)
            # Context arrives in two pieces, as it does across decoding cycles.
            cache = DraftCache(len(model.layers))
            cut = p // 2
            if cut:
                model.forward_cached(embeds[:1, block], features[:1, :cut], cut, cache)
            out = model.forward_cached(embeds[:1, block], features[:1, cut:p], p, cache)
            assert cache.length == p  # only context entries are cached
            torch.testing.assert_close(out[0], train_out[0, block], atol=1e-5, rtol=1e-5)


def test_cache_must_cover_exactly_the_positions_before_the_anchor():
    model = DFlashDraftModel(small_config())
    cache = DraftCache(len(model.layers))
    with pytest.raises(ValueError, match="before the anchor"):
        model.forward_cached(torch.zeros(1, 4, 32), torch.zeros(1, 5, 64), 6, cache)


def test_trainable_state_dict_uses_serving_names():
    model = DFlashDraftModel(small_config())
    keys = set(model.trainable_state_dict())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.1.mlp.down_proj.weight",
    } <= keys
    assert not any(k.startswith(("rotary", "model.", "embed", "lm_head")) for k in keys)
    assert model.fc.weight.shape == (32, 64)


def _kernel_case(num_chunks, dtype=torch.float32, kv_heads=2):
    # Row 0 has an anchor at 0 (no visible context); row 1 ends in padding blocks.
    gen = torch.Generator().manual_seed(num_chunks)
    seq, n, bs = 40, 6, 4
    anchors, valid = pack_anchors([np.array([0, 5, 9, 20, 30, 37]), np.array([1, 3, 7])], n)
    layout = make_layout(anchors, valid, bs, "cpu", num_chunks=num_chunks)
    shapes = [
        (2, 4, n * bs, 8),
        (2, kv_heads, seq, 8),
        (2, kv_heads, seq, 8),
        (2, kv_heads, n * bs, 8),
        (2, kv_heads, n * bs, 8),
    ]
    inputs = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    return inputs, layout, torch.randn(shapes[0], generator=gen)


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped queries, and one kv head per query head
@pytest.mark.parametrize("num_chunks", [1, 3, 6])
def test_blockwise_kernel_matches_dense_outputs_and_input_gradients(num_chunks, kv_heads):
    inputs, layout, weights = _kernel_case(num_chunks, kv_heads=kv_heads)
    results = {}
    for backend in ("dense", "blockwise"):
        xs = [t.clone().requires_grad_() for t in inputs]
        out = block_attention(*xs, layout, backend)
        # As the drafter reads it: (batch, rows, heads, d), so the incoming gradient is strided.
        (out.transpose(1, 2) * weights.transpose(1, 2)).sum().backward()
        results[backend] = [out.detach(), *(x.grad for x in xs)]
    for got, want in zip(results["blockwise"], results["dense"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_blockwise_kernel_in_bfloat16_stays_close_to_float32():
    inputs, layout, weights = _kernel_case(3)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        xs = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = block_attention(*xs, layout, "blockwise")
        (out.float() * weights).sum().backward()
        assert out.dtype == dtype and all(x.grad.dtype == dtype for x in xs)
        results.append([out.detach().float(), *(x.grad.float() for x in xs)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


@pytest.mark.parametrize(
    ("backend", "whole_context"), [*((b, False) for b in BACKENDS), ("flex", True)]
)
def test_an_anchor_chunk_alone_gives_the_rows_of_the_whole_forward(backend, whole_context):
    # What makes the chunked training step exact: blocks never see each other, and a chunk needs
    # only the context prefix its anchors can see (flex gets the whole context on GPUs, to keep
    # one compiled shape; the mask hides the rest).
    torch.manual_seed(0)
    check_chunks_alone(DFlashDraftModel(small_config()), 6, backend, whole_context)


def check_chunks_alone(model, seed: int, backend: str, whole_context: bool = False) -> None:
    """Each anchor chunk through `model.blocks` with only its context prefix (or the whole
    context) gives the rows of the forward over every block."""
    features, embeds, layout = _inputs(seed=seed, blocks=6)
    layout = make_layout(layout.anchors, layout.valid, layout.block_size, "cpu", num_chunks=3)
    bs = layout.block_size
    with torch.no_grad():
        whole = model(embeds, features, layout, backend)
        kv = model.context_kv(features)
        for lo, hi, ctx_len in layout.chunks:
            assert ctx_len < features.shape[1]
            seen = None if whole_context else ctx_len
            prefix = [(k[:, :, :seen], v[:, :, :seen]) for k, v in kv]
            part = model.blocks(
                embeds[:, lo * bs : hi * bs], prefix, layout.slice_blocks(lo, hi), backend
            )
            torch.testing.assert_close(part, whole[:, lo * bs : hi * bs], atol=1e-5, rtol=1e-5)


def test_flex_gets_every_operand_in_autocasts_dtype(monkeypatch):
    # Under autocast the fp32 norms hand over fp32 queries and keys beside bf16 values; flex (no
    # autocast of its own) must get one dtype, as the blockwise kernel does.
    import torch.nn.attention.flex_attention as flex_module

    seen = []
    real = flex_module.flex_attention

    def recording(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", recording)
    inputs, layout, _ = _kernel_case(3)
    mixed = [inputs[0], inputs[1], inputs[2].bfloat16(), inputs[3], inputs[4].bfloat16()]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_attention(*mixed, layout, "flex")
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    want = block_attention(*inputs, layout, "dense")
    torch.testing.assert_close(out.float(), want, atol=0.1, rtol=0.05)


# ----------------------------------------------------------------------------- sliding windows
# Windows shorter than the context (24 positions, anchors up to 22), the official in-block rule
# (sliding layers causal) and its two overrides; W = 3 < B = 4 also windows the block itself.
LAYOUTS = {
    "sliding-causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "sliding-bidirectional": dict(
        layer_types=["sliding_attention", "sliding_attention"], sliding_window=3, is_causal=False
    ),
    "all-causal": dict(
        layer_types=["full_attention", "sliding_attention"], sliding_window=6, is_causal=True
    ),
}


def sliding_model(name: str, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(small_config(**LAYOUTS[name]))


def test_old_configs_without_layer_fields_load_as_full_attention():
    data = small_config().to_dict()
    for key in ("layer_types", "sliding_window", "is_causal"):
        data.pop(key)
    config = DFlashConfig.from_dict(data)
    assert config.layer_types == ["full_attention"] * 2
    assert [config.layer_window(i) for i in range(2)] == [None, None]
    assert [config.layer_causal(i) for i in range(2)] == [False, False]


def test_the_in_block_rule_follows_the_reference_client():
    cfg = small_config(**LAYOUTS["sliding-causal"])
    assert [cfg.layer_causal(i) for i in range(2)] == [True, False]  # sliding causal, full not
    assert [cfg.layer_window(i) for i in range(2)] == [5, None]
    cfg = small_config(**LAYOUTS["sliding-bidirectional"])
    assert [cfg.layer_causal(i) for i in range(2)] == [False, False]
    cfg = small_config(**LAYOUTS["all-causal"])
    assert [cfg.layer_causal(i) for i in range(2)] == [True, True]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"layer_types": ["sliding_attention", "full_attention"]}, "need sliding_window >= 1"),
        ({"sliding_window": 8}, "no draft layer is 'sliding_attention'"),
        ({"layer_types": ["full_attention"], "sliding_window": None}, "1 entries for 2"),
        ({"layer_types": ["linear_attention"] * 2}, "unknown layer types"),
    ],
)
def test_bad_layer_layouts_name_the_problem(kw, needle):
    with pytest.raises(ValueError, match=needle):
        small_config(**kw)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_all_backends_agree_forward_with_sliding_windows(name):
    model = sliding_model(name)
    features, embeds, layout = _inputs(seed=7, blocks=6)
    layout = make_layout(layout.anchors, layout.valid, layout.block_size, "cpu", num_chunks=3)
    with torch.no_grad():
        outs = {b: model(embeds, features, layout, b) for b in BACKENDS}
        full = DFlashDraftModel(small_config())
        full.load_state_dict(model.state_dict())
        unwindowed = full(embeds, features, layout, "dense")
    for b in ("blockwise", "flex"):
        torch.testing.assert_close(outs[b], outs["dense"], atol=1e-5, rtol=1e-5)
    assert (outs["dense"] - unwindowed).abs().max() > 1e-3  # the windows did hide something


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sliding_block_sees_context_within_the_window_only(backend):
    # Every layer sliding (W = 5): the block's rows see context k > p + i - 5 >= p - 4, so the
    # feature at p - 5 never reaches the block, while the one at p - 4 does (through offset 0).
    torch.manual_seed(0)
    model = DFlashDraftModel(small_config(layer_types=["sliding_attention"] * 2, sliding_window=5))
    features, embeds, layout = _inputs(seed=8)
    row, j = 0, 2
    p, bs = int(layout.anchors[row, j]), layout.block_size
    assert p >= 6
    block = slice(j * bs, (j + 1) * bs)
    with torch.no_grad():
        base = model(embeds, features, layout, backend)
        outside = features.clone()
        outside[row, : p - 4] += 5.0
        out = model(embeds, outside, layout, backend)
        torch.testing.assert_close(out[row, block], base[row, block], atol=1e-5, rtol=0)
        inside = features.clone()
        inside[row, p - 4] += 5.0
        out = model(embeds, inside, layout, backend)
        assert (out[row, block.start] - base[row, block.start]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_layers_hide_later_block_tokens(backend):
    model = sliding_model("all-causal")
    features, embeds, layout = _inputs(seed=9)
    bs = layout.block_size
    with torch.no_grad():
        base = model(embeds, features, layout, backend)
        poked = embeds.clone()
        poked[0, bs + 2] += 3.0  # block 1, offset 2
        out = model(poked, features, layout, backend)
    changed = (out - base).abs().amax(-1)[0, bs : 2 * bs]
    assert torch.all(changed[:2] < 1e-5) and torch.all(changed[2:] > 1e-4)


@pytest.mark.parametrize(("window", "causal"), [(5, True), (5, False), (3, False), (None, True)])
@pytest.mark.parametrize("num_chunks", [1, 3, 6])
def test_blockwise_kernel_matches_dense_with_windows_and_causal_blocks(window, causal, num_chunks):
    inputs, layout, weights = _kernel_case(num_chunks)
    results = {}
    for backend in ("dense", "blockwise"):
        xs = [t.clone().requires_grad_() for t in inputs]
        out = block_attention(*xs, layout, backend, window, causal)
        (out * weights).sum().backward()
        results[backend] = [out.detach(), *(x.grad for x in xs)]
    for got, want in zip(results["blockwise"], results["dense"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        flex = block_attention(*inputs, layout, "flex", window, causal)
    torch.testing.assert_close(flex, results["dense"][0], atol=1e-5, rtol=1e-5)


def test_the_chunk_plan_knows_where_each_chunk_may_start_reading():
    _, layout, _ = _kernel_case(3)  # row 0 anchors 0 5 9 20 30 37, row 1 anchors 1 3 7
    assert [c[:2] for c in layout.chunks] == [(0, 2), (2, 4), (4, 6)]
    assert layout.chunk_first_anchors == [0, 7, 30]  # padding blocks of row 1 do not count
    assert layout.slice_blocks(4, 5).chunk_first_anchors == [30]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cached_inference_matches_training_forward_with_sliding_windows(name):
    check_cached_matches_training(sliding_model(name, seed=1), 10, "blockwise")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_anchor_chunk_alone_gives_the_whole_forwards_rows_with_windows(backend):
    # With windows the blockwise kernel also skips the context before first anchor - W + 1.
    check_chunks_alone(sliding_model("sliding-bidirectional", seed=2), 11, backend)


@pytest.mark.parametrize(("window", "causal"), [(None, False), (5, True), (3, False)])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_the_context_read_in_tiles_matches_dense_with_gradients(
    window, causal, num_chunks, monkeypatch
):
    """Long rows: past CONTEXT_SCORES_BYTES a chunk reads its context in tiles (online softmax,
    recomputed in backward); forced here with a budget of a few keys per tile."""
    import dflash_train.model.block_attention as ba
    from pipeline_helpers import record_context_tiles

    calls = record_context_tiles(monkeypatch)
    monkeypatch.setattr(ba, "context_tile", lambda rows, s: 7)  # 7 keys a tile: several
    inputs, layout, weights = _kernel_case(num_chunks)
    results = {}
    for backend in ("dense", "blockwise"):
        xs = [t.clone().requires_grad_() for t in inputs]
        out = block_attention(*xs, layout, backend, window, causal)
        (out * weights).sum().backward()
        results[backend] = [out.detach(), *(x.grad for x in xs)]
    assert calls and set(calls) == {7}
    for got, want in zip(results["blockwise"], results["dense"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_long_context_is_tiled_only_past_the_score_budget():
    from dflash_train.model.context_tiles import CONTEXT_SCORES_BYTES, context_tile

    assert context_tile(1024, 1024) is None  # 4 MiB of scores: one pass, nothing recomputed
    rows = 4 * 1024  # heads x one chunk's block rows
    tile = context_tile(rows, 32768)  # 512 MiB at once: tiled
    assert tile is not None and rows * tile * 4 <= CONTEXT_SCORES_BYTES
