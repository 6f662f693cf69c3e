"""A drafter replica: schedule, zero-weight steps, identical replicas, and that it can learn."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch

from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import BatchSpec
from dflash_train.data.dataset import PreparedDataset, write_prepared
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import (
    TargetFeatureExtractor,
    draft_config_from_target,
    feature_layer_ids,
    load_frozen_head,
    load_target_config,
)
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.pipeline.prefetch import BatchBuilder
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.sync import sum_into_all
from dflash_train.train.replica import DraftReplica, lr_at


def test_lr_warms_up_linearly_then_decays_by_cosine():
    opts = OptimOptions(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, opts) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_at(55, 100, opts) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)


def _setup(tiny_target, tmp_path, rows=4, length=64):
    target_cfg = load_target_config(tiny_target)
    dcfg = draft_config_from_target(target_cfg, 1, 8, mask_token_id=255, num_features=3)
    rng = np.random.default_rng(0)
    data = []
    for _ in range(rows):
        ids = rng.integers(0, 250, length)
        mask = np.ones(length, np.uint8)
        mask[:8] = 0
        data.append((ids, mask))
    write_prepared(tmp_path / "data", data)
    ds = PreparedDataset(tmp_path / "data")
    builder = BatchBuilder(ds, [length], 8, num_anchors=16, gamma=4.0, mask_token_id=255, seed=0)
    job = builder.build(BatchSpec(0, 0, 0, tuple(range(rows))))
    ex = TargetFeatureExtractor(
        tiny_target, dcfg.target_layer_ids, torch.device("cpu"), torch.float32
    )
    batch = HSBatch(job, ex(job.input_ids))
    head = load_frozen_head(tiny_target)
    return dcfg, head, batch


def _replica(model, head, steps=100, lr=3e-3, dtype=torch.float32, **objective):
    return DraftReplica(
        model,
        head,
        torch.device("cpu"),
        dtype,
        ObjectiveOptions(**{"attention": "blockwise", **objective}),
        OptimOptions(lr=lr, warmup_ratio=0.0),
        steps,
    )


def test_training_overfits_a_few_sequences(tmp_path):
    # A target whose logits have a trained model's scale (not transformers' near-flat default).
    target = save_random_qwen3(tmp_path / "target", initializer_range=0.2)
    torch.manual_seed(0)
    dcfg, head, batch = _setup(target, tmp_path)
    rep = _replica(DFlashDraftModel(dcfg), head, steps=60, lr=1e-2)
    losses = []
    for _ in range(60):
        out = rep.micro_step(batch)
        rep.apply(batch.job.weight_sum)
        losses.append(float(out.loss_sum) / batch.job.weight_sum)
    assert losses[-1] < losses[0] / 8, (losses[0], losses[-1])


def test_replicas_summing_gradients_stay_identical(tiny_target, tmp_path):
    torch.manual_seed(0)
    dcfg, head, batch = _setup(tiny_target, tmp_path)
    model = DFlashDraftModel(dcfg)
    reps = [_replica(copy.deepcopy(model), head), _replica(copy.deepcopy(model), head)]
    for _ in range(3):
        reps[0].micro_step(batch)  # replica 1 has no data this step: zero gradients
        sum_into_all([r.flat_grad for r in reps])
        for r in reps:
            r.apply(batch.job.weight_sum)
    for a, b in zip(reps[0].model.parameters(), reps[1].model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert reps[0].step == 3


def test_zero_global_weight_skips_the_update_and_counts_the_step(tiny_target, tmp_path):
    torch.manual_seed(0)
    dcfg, head, _batch = _setup(tiny_target, tmp_path)
    rep = _replica(DFlashDraftModel(dcfg), head)
    before = [p.detach().clone() for p in rep.params]
    assert rep.apply(0.0) is None
    assert rep.step == 1  # the schedule's step, with nothing to apply
    assert all(torch.equal(a, b) for a, b in zip(before, rep.params, strict=True))
    assert len(rep.optimizer.state) == 0


def test_loss_chunk_size_does_not_change_the_gradients(tiny_target, tmp_path):
    torch.manual_seed(0)
    dcfg, head, batch = _setup(tiny_target, tmp_path)
    model = DFlashDraftModel(dcfg)
    grads = []
    for chunk in (7, 100000):
        rep = _replica(copy.deepcopy(model), head, loss_chunk_size=chunk)
        rep.micro_step(batch)
        grads.append(rep.flat_grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("attention", "chunks", "sliding", "arch"),
    [
        ("blockwise", 3, False, "dflash"),
        ("dense", 8, False, "dflash"),
        ("blockwise", 1, False, "dflash"),
        ("blockwise", 3, True, "dflash"),
        ("blockwise", 3, True, "dflash2"),
    ],
)
def test_chunked_step_gives_the_whole_steps_loss_and_gradients(
    tiny_target, tmp_path, attention, chunks, sliding, arch
):
    # Rows with few supervised positions leave padding blocks, so some chunks carry no target.
    # A sliding layer (window 5 << 64) makes later chunks skip the context before their window.
    # DFlash 2: convolutions and selector moved off their initial values, so both act.
    torch.manual_seed(0)
    dcfg, head, _ = _setup(tiny_target, tmp_path)
    if sliding:
        dcfg = dataclasses.replace(dcfg, layer_types=["sliding_attention"], sliding_window=5)
    if arch == "dflash2":
        dcfg = dataclasses.replace(dcfg, arch=arch, selector_rank=16, selector_top_k=8)
    rng = np.random.default_rng(1)
    data = []
    for keep in (60, 12, 5):
        mask = np.zeros(64, np.uint8)
        mask[64 - keep :] = 1
        data.append((rng.integers(0, 250, 64), mask))
    write_prepared(tmp_path / "mixed", data)
    builder = BatchBuilder(
        PreparedDataset(tmp_path / "mixed"),
        [64],
        8,
        num_anchors=16,
        gamma=4.0,
        mask_token_id=255,
        seed=0,
        attention_chunks=chunks,
    )
    job = builder.build(BatchSpec(0, 0, 0, (0, 1, 2)))
    assert not bool(job.layout.valid.all())
    ex = TargetFeatureExtractor(
        tiny_target, dcfg.target_layer_ids, torch.device("cpu"), torch.float32
    )
    batch = HSBatch(job, ex(job.input_ids))
    model = DFlashDraftModel(dcfg)
    if arch == "dflash2":
        _perturb_dflash2_modules(model)
    # A random drafter's top K rarely holds the gold token: injected misses train every row.
    extra = {"selector_misses": "inject"} if arch == "dflash2" else {}
    results = []
    for chunked in (False, True):
        rep = _replica(
            copy.deepcopy(model), head, attention=attention, chunked_step=chunked, **extra
        )
        out = rep.micro_step(batch)
        results.append((out, rep.flat_grad.clone()))
    (whole, g_whole), (chunked, g_chunked) = results
    assert float(g_whole.abs().sum()) > 0
    torch.testing.assert_close(chunked.loss_sum, whole.loss_sum, atol=1e-4, rtol=1e-5)
    assert torch.equal(chunked.count, whole.count) and torch.equal(chunked.correct, whole.correct)
    torch.testing.assert_close(g_chunked, g_whole, atol=1e-5, rtol=1e-4)
    if arch == "dflash2":
        assert torch.equal(chunked.selector[:2], whole.selector[:2])  # recall, selector hits
        torch.testing.assert_close(chunked.selector[2], whole.selector[2], atol=1e-4, rtol=1e-5)
        names = [n for n, _ in model.named_parameters()]
        sizes = [p.numel() for p in model.parameters()]
        grads = dict(zip(names, g_whole.split(sizes), strict=True))
        for name in ("candidate_selector.successor_codebook", "layers.0.mlp_conv.base_kernel"):
            assert float(grads[name].abs().sum()) > 0, name


def _perturb_dflash2_modules(model: DFlashDraftModel) -> None:
    """Move DFlash 2's convolutions and codebooks off their initial values (which make the
    convolutions the identity and the pair term zero), so a test sees them act."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                p.add_(0.05 * torch.randn_like(p))


def test_bfloat16_autocast_step_runs_both_ways_and_agrees_with_float32(tiny_target, tmp_path):
    # The mixed-precision path CUDA uses (fp32 master weights, bf16 matmuls), here on CPU.
    torch.manual_seed(0)
    dcfg, head, batch = _setup(tiny_target, tmp_path)
    model = DFlashDraftModel(dcfg)
    results = {}
    for dtype, chunked in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
        rep = _replica(copy.deepcopy(model), head, dtype=dtype, chunked_step=chunked)
        out = rep.micro_step(batch)
        assert torch.isfinite(out.loss_sum) and next(rep.model.parameters()).dtype == torch.float32
        results[dtype, chunked] = (float(out.loss_sum), rep.flat_grad.clone())
    loss32, g32 = results[torch.float32, True]
    for key in ((torch.bfloat16, True), (torch.bfloat16, False)):
        loss, g = results[key]
        assert loss == pytest.approx(loss32, rel=2e-2)
        assert float((g - g32).norm() / g32.norm()) < 0.05, key


def test_stage_times_count_once_per_micro_batch_however_many_chunks(tiny_target, tmp_path):
    # time/<stage> in the metrics is seconds per event: a chunked micro-batch is one event.
    torch.manual_seed(0)
    dcfg, head, batch = _setup(tiny_target, tmp_path)
    assert len(batch.job.layout.chunks) > 1
    rep = _replica(DFlashDraftModel(dcfg), head)
    rep.micro_step(batch)
    rep.micro_step(batch)
    seconds, counts = rep.timers.snapshot()
    for stage in ("drafter_forward_s", "drafter_backward_s"):
        assert counts[stage] == 2 and seconds[stage] > 0


def test_uniform_selector_weights_change_the_dflash2_gradient_at_the_same_scale(
    tiny_target, tmp_path
):
    from dflash_train.objective import uniform_position_weight

    dcfg, head, batch = _setup(tiny_target, tmp_path)
    dcfg = dataclasses.replace(dcfg, arch="dflash2", selector_rank=16, selector_top_k=8)
    model = DFlashDraftModel(dcfg)
    model.init_weights(seed=0)
    _perturb_dflash2_modules(model)
    grads = {}
    for weights in ("decayed", "uniform"):
        rep = _replica(copy.deepcopy(model), head, selector_weights=weights, gamma=4.0)
        rep.micro_step(batch)
        grads[weights] = rep.flat_grad.clone()
    assert rep.selector.uniform_weight == pytest.approx(uniform_position_weight(8, 4.0))
    assert not torch.allclose(grads["decayed"], grads["uniform"])
    ratio = grads["uniform"].norm() / grads["decayed"].norm()
    assert 0.5 < float(ratio) < 2.0  # the shape of the weights changed, not the term's scale


# ----------------------------------------------------------------------------- objectives
def _uneven_rows(tiny_target, tmp_path, arch="dflash"):
    """Four rows with 1, 1, 4 and 4 valid anchors (the split that exposed NeMo Automodel's
    rank-dependent D-PACE divisor), and a drafter whose DFlash 2 modules act."""
    dcfg, head, _ = _setup(tiny_target, tmp_path)
    if arch == "dflash2":
        dcfg = dataclasses.replace(dcfg, arch=arch, selector_rank=16, selector_top_k=8)
    rng = np.random.default_rng(2)
    data = []
    for supervised in (2, 2, 5, 5):
        mask = np.zeros(64, np.uint8)
        mask[64 - supervised :] = 1
        data.append((rng.integers(0, 250, 64), mask))
    write_prepared(tmp_path / "uneven", data)
    ds = PreparedDataset(tmp_path / "uneven")
    ex = TargetFeatureExtractor(
        tiny_target, dcfg.target_layer_ids, torch.device("cpu"), torch.float32
    )
    torch.manual_seed(0)
    model = DFlashDraftModel(dcfg)
    if arch == "dflash2":
        _perturb_dflash2_modules(model)
    return ds, ex, model, head


def _batches(ds, ex, rows, position_weights, chunks=8):
    builder = BatchBuilder(
        ds, [64], 8, num_anchors=16, gamma=4.0, mask_token_id=255, seed=0,
        attention_chunks=chunks, position_weights=position_weights,
    )  # fmt: skip
    job = builder.build(BatchSpec(0, 0, 0, tuple(rows)))
    return HSBatch(job, ex(job.input_ids))


@pytest.mark.parametrize(
    ("arch", "position_weights"),
    [("dflash", "dpace"), ("dflash2", "dpace"), ("dflash", "decay"), ("dflash2", "decay")],
)
def test_the_update_does_not_depend_on_how_rows_are_split(
    tiny_target, tmp_path, arch, position_weights
):
    # One micro-batch of all rows; two accumulated micro-batches; two replicas with two rows
    # each (other anchor chunks too): the same normalised gradient, i.e. the same update.
    ds, ex, model, head = _uneven_rows(tiny_target, tmp_path, arch)
    extra = {"selector_misses": "inject"} if arch == "dflash2" else {}
    objective = dict(position_weights=position_weights, **extra)
    splits = {
        "one batch": [[(0, 1, 2, 3)]],
        "accumulated": [[(0, 2), (1, 3)]],
        "two replicas": [[(0, 1)], [(2, 3)]],  # 2 and 8 anchors
    }
    grads, params, local_means = {}, {}, {}
    for name, per_replica in splits.items():
        reps = [_replica(copy.deepcopy(model), head, **objective) for _ in per_replica]
        weight = 0.0
        local = []
        for rep, jobs in zip(reps, per_replica, strict=True):
            mine = 0.0
            for rows in jobs:
                batch = _batches(ds, ex, rows, position_weights, chunks=3 if len(rows) < 4 else 8)
                rep.micro_step(batch)
                mine += batch.job.weight_sum
            local.append(rep.flat_grad.clone() / mine)
            weight += mine
        sum_into_all([r.flat_grad for r in reps])
        grads[name] = reps[0].flat_grad.clone() / weight
        local_means[name] = sum(local) / len(local)  # each replica by its own divisor: wrong
        for rep in reps:
            rep.apply(weight)
        params[name] = [torch.cat([p.flatten() for p in r.params]) for r in reps]
    if position_weights == "dpace":
        # Anchors 1 + 1 + 4 + 4: the divisor counts blocks, whatever the split.
        assert _batches(ds, ex, (0, 1, 2, 3), "dpace").job.weight_sum == 10.0
    ref = grads["one batch"]
    assert float(ref.abs().sum()) > 0
    for name in ("accumulated", "two replicas"):
        torch.testing.assert_close(grads[name], ref, atol=1e-6, rtol=1e-5)
    # The optimizer's input is that gradient; replicas of one step apply identical updates.
    # (The parameters after AdamW's first step, ~lr * sign(g), are no sharper a check: a
    # gradient of ~1e-8 may round either way.)
    assert torch.equal(*params["two replicas"])
    # The test can fail: a replica-local divisor (NeMo Automodel's bug) gives another gradient.
    assert not torch.allclose(local_means["two replicas"], ref, atol=1e-4, rtol=1e-3)


def test_dpace_changes_the_gradient_and_logs_its_weights(tiny_target, tmp_path):
    ds, ex, model, head = _uneven_rows(tiny_target, tmp_path)
    out = {}
    for kind in ("decay", "dpace"):
        rep = _replica(copy.deepcopy(model), head, position_weights=kind, dpace_alpha=0.3)
        batch = _batches(ds, ex, (0, 1, 2, 3), kind)
        out[kind] = (rep.micro_step(batch), rep.flat_grad.clone() / batch.job.weight_sum)
    (decay, g_decay), (dpace, g_dpace) = out["decay"], out["dpace"]
    assert not torch.allclose(g_decay, g_dpace, rtol=1e-2)
    mean = dpace.pos_weight[1:] / dpace.count[1:].clamp(min=1)
    assert torch.all(mean[:-1] >= mean[1:])  # credit falls along the block
    assert float(mean[0]) >= 0.3  # w_1 >= q~_1 >= alpha: a random drafter's credit
    seen = decay.count[1:] > 0  # offsets 5-7 lie past these short rows' ends
    got = decay.pos_weight[1:][seen] / decay.count[1:][seen]
    torch.testing.assert_close(got, decay_weights_of(8, 4.0)[seen])


def decay_weights_of(block_size: int, gamma: float) -> torch.Tensor:
    from dflash_train.objective import decay_weights

    return decay_weights(block_size, gamma)[1:]


def test_muon_takes_the_backbone_matrices_and_resumes_from_its_saved_state(tiny_target, tmp_path):
    from dflash_train.train.checkpoint import optimizer_tensors, restore_optimizer
    from dflash_train.train.optimizers import split_for_muon

    dcfg, head, batch = _setup(tiny_target, tmp_path)
    dcfg = dataclasses.replace(dcfg, arch="dflash2", selector_rank=16, selector_top_k=8)
    torch.manual_seed(0)
    model = DFlashDraftModel(dcfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon, rest = split_for_muon(named)
    names = {id(p): n for n, p in named}
    assert sorted(names[id(p)] for p in muon) == sorted(
        ["fc.weight"]
        + [f"layers.0.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    )
    assert any("kernel_projection" in names[id(p)] for p in rest)
    assert any("successor_codebook" in names[id(p)] for p in rest)

    def muon_replica(m):
        return DraftReplica(
            m, head, torch.device("cpu"), torch.float32,
            ObjectiveOptions(attention="blockwise"),
            OptimOptions(lr=3e-3, warmup_ratio=0.0, optimizer="muon", muon_lr=1e-3), 10,
        )  # fmt: skip

    a = muon_replica(copy.deepcopy(model))
    for _ in range(2):
        a.micro_step(batch)
        a.apply(batch.job.weight_sum)
    groups = {g["peak_lr"] for g in a.optimizer.param_groups}
    assert groups == {1e-3, 3e-3}  # Muon at --muon-lr, AdamW at --lr
    saved = optimizer_tensors(a.model, a.optimizer)
    assert "fc.weight.momentum_buffer" in saved and "fc.weight.exp_avg" not in saved
    assert "norm.weight.exp_avg" in saved
    # A fresh replica from the saved weights and state steps exactly as the original goes on.
    b = muon_replica(copy.deepcopy(a.model))
    restore_optimizer(b.model, b.optimizer, saved)
    b.step = a.step
    for rep in (a, b):
        rep.micro_step(batch)
        rep.apply(batch.job.weight_sum)
    for p, q in zip(a.params, b.params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("loss", "arch"),
    [("kl", "dflash"), ("lk_alpha", "dflash"), ("lk_lambda", "dflash"), ("lk_lambda", "dflash2")],
)
def test_a_teacher_loss_reads_the_features_last_slot_and_chunks_agree(
    tiny_target, tmp_path, loss, arch
):
    # The features end with the teacher's input; the drafter reads the slots before it. The
    # chunked step gives the whole step's loss and gradients, and the teacher's slot is what
    # the loss compares with (another teacher, another gradient; the ce loss ignores it).
    torch.manual_seed(0)
    dcfg, head, plain = _setup(tiny_target, tmp_path)
    if arch == "dflash2":
        dcfg = dataclasses.replace(dcfg, arch=arch, selector_rank=16, selector_top_k=8)
    ids = feature_layer_ids(dcfg.target_layer_ids, True)
    ex = TargetFeatureExtractor(tiny_target, ids, torch.device("cpu"), torch.float32)
    batch = HSBatch(plain.job, ex(plain.job.input_ids))
    torch.testing.assert_close(batch.features[..., : plain.features.shape[-1]], plain.features)
    model = DFlashDraftModel(dcfg)
    if arch == "dflash2":
        _perturb_dflash2_modules(model)
    grads = {}
    for chunked in (False, True):
        rep = _replica(copy.deepcopy(model), head, chunked_step=chunked, loss=loss)
        assert rep.feature_width == batch.features.shape[-1]
        out = rep.micro_step(batch)
        grads[chunked] = (out, rep.flat_grad.clone())
    (whole, g_whole), (chunked, g_chunked) = grads[False], grads[True]
    assert float(g_whole.abs().sum()) > 0 and torch.isfinite(g_whole).all()
    torch.testing.assert_close(chunked.loss_sum, whole.loss_sum, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(g_chunked, g_whole, atol=1e-5, rtol=1e-4)
    other = batch.features.clone()
    other[..., plain.features.shape[-1] :] = torch.roll(
        other[..., plain.features.shape[-1] :], 1, 1
    )
    rep = _replica(copy.deepcopy(model), head, loss=loss)
    rep.micro_step(HSBatch(batch.job, other))
    assert not torch.allclose(rep.flat_grad, g_whole, rtol=1e-3)
    ce = _replica(copy.deepcopy(model), head)
    ce.micro_step(plain)
    assert not torch.allclose(ce.flat_grad, g_whole, rtol=1e-3)
