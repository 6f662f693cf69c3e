"""The micro-step's fewer operations train the same: one autocast region per micro-step, the
context's keys and values cast once, and a micro-batch under `whole_step_tokens` in one pass
give the loss and gradients of the chunked step as it ran before (written out here)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import BatchSpec
from dflash_train.data.dataset import PreparedDataset, write_prepared
from dflash_train.model.block_attention import BlockLayout
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import (
    TargetFeatureExtractor,
    draft_config_from_target,
    load_frozen_head,
    load_target_config,
)
from dflash_train.pipeline.prefetch import BatchBuilder
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.replica import DraftReplica, whole_step_tokens_for

CPU = torch.device("cpu")


def chunked_step_before(rep: DraftReplica, batch: HSBatch):
    """The chunked step as `train/replica.py` ran it before the cuts (main at 3f403e5):
    autocast entered per anchor chunk, the context's fp32 leaves sliced and cast per chunk."""
    job, b = batch.job, rep.block_size
    with rep._autocast():
        embeds = rep.head.embed_tokens(job.block_ids)
        context_kv = rep.model.context_kv(batch.features)
    layout = job.layout
    chunks = job.targets.split_by_chunks(layout.num_blocks, b, layout.chunks)
    leaves = [t.detach().float().requires_grad_() for pair in context_kv for t in pair]
    dtype = context_kv[0][0].dtype
    pairs = list(zip(leaves[0::2], leaves[1::2], strict=True))
    total = None
    for (lo, hi, ctx_len), targets in zip(layout.chunks, chunks, strict=True):
        if not len(targets):
            continue
        sub = layout.slice_blocks(lo, hi)
        with rep._autocast():
            kv = [(k[:, :, :ctx_len].to(dtype), v[:, :, :ctx_len].to(dtype)) for k, v in pairs]
            hidden = rep.model.blocks(embeds[:, lo * b : hi * b], kv, sub, rep.attention)
            out = rep._loss(hidden, (targets, None), None)
        out.loss_sum.backward()
        total = out if total is None else total.add_(out)
    flat = [t for pair in context_kv for t in pair]
    grads = [(t, leaf.grad) for t, leaf in zip(flat, leaves, strict=True) if leaf.grad is not None]
    torch.autograd.backward([t for t, _ in grads], [g.to(t.dtype) for t, g in grads])
    return total.loss_sum.detach(), rep.flat_grad.clone()


def _batch(target, tmp_path, dcfg):
    rng = np.random.default_rng(1)
    data = []
    for keep in (60, 12, 40):  # few supervised positions leave padding blocks
        mask = np.zeros(64, np.uint8)
        mask[64 - keep :] = 1
        data.append((rng.integers(0, 250, 64), mask))
    write_prepared(tmp_path / "data", data)
    builder = BatchBuilder(
        PreparedDataset(tmp_path / "data"),
        [64],
        8,
        num_anchors=16,
        gamma=4.0,
        mask_token_id=255,
        seed=0,
        attention_chunks=3,
    )
    job = builder.build(BatchSpec(0, 0, 0, (0, 1, 2)))
    ex = TargetFeatureExtractor(target, dcfg.target_layer_ids, CPU, torch.float32)
    return HSBatch(job, ex(job.input_ids))


def _replica(model, head, dtype, attention, tokens):
    objective = ObjectiveOptions(attention=attention, whole_step_tokens=tokens)
    return DraftReplica(model, head, CPU, dtype, objective, OptimOptions(), 10)


@pytest.mark.parametrize(
    ("attention", "arch", "dtype"),
    [
        ("dense", "dflash", torch.float32),
        ("blockwise", "dflash", torch.float32),
        ("blockwise", "dflash2", torch.float32),
        ("dense", "dflash", torch.bfloat16),
        ("blockwise", "dflash", torch.bfloat16),
        ("blockwise", "dflash2", torch.bfloat16),
    ],
)
def test_the_micro_step_trains_what_the_chunked_step_did_before(
    tiny_target, tmp_path, attention, arch, dtype
):
    torch.manual_seed(0)
    dcfg = draft_config_from_target(
        load_target_config(tiny_target), 2, 8, mask_token_id=255, num_features=3
    )
    kinds = ["sliding_attention", "full_attention"]
    dcfg = dataclasses.replace(dcfg, layer_types=kinds, sliding_window=5)
    if arch == "dflash2":
        dcfg = dataclasses.replace(dcfg, arch=arch, selector_rank=16, selector_top_k=8)
    head = load_frozen_head(tiny_target)
    batch = _batch(tiny_target, tmp_path, dcfg)
    model = DFlashDraftModel(dcfg)
    with torch.no_grad():  # DFlash 2's modules off their identity start, so they act
        for name, p in model.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                p.add_(0.05 * torch.randn_like(p))
    before = chunked_step_before(_replica(copy.deepcopy(model), head, dtype, attention, 0), batch)
    assert float(before[1].abs().sum()) > 0
    for tokens in (0, 1 << 20):  # chunked, then in one pass
        rep = _replica(copy.deepcopy(model), head, dtype, attention, tokens)
        assert rep.runs_chunked(3, batch.job.layout.num_blocks) == (tokens == 0)
        out = rep.micro_step(batch)
        if tokens == 0:  # the same operations on the same values, in the same order
            assert torch.equal(out.loss_sum, before[0]) and torch.equal(rep.flat_grad, before[1])
        elif dtype == torch.float32:  # summed in another order: fp32 rounding
            torch.testing.assert_close(out.loss_sum, before[0], atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(rep.flat_grad, before[1], atol=1e-5, rtol=1e-4)
        else:  # bf16 matmuls over every block at once: rounded once, not once per chunk
            assert float(out.loss_sum) == pytest.approx(float(before[0]), rel=1e-2)
            assert float((rep.flat_grad - before[1]).norm() / before[1].norm()) < 2e-2


def test_whole_step_tokens_fit_the_gpus_memory_and_refuse_negatives():
    recipe = 4 * 512 * 16  # the Qwen3-8B recipe's micro-batch of block tokens
    assert whole_step_tokens_for(150_000_000_000, 4096, 5) >= recipe  # an H200: one pass
    assert whole_step_tokens_for(85_000_000_000, 4096, 5) < recipe  # 80 GB: chunked
    fp32 = whole_step_tokens_for(150_000_000_000, 4096, 5, torch.float32)
    assert fp32 == pytest.approx(whole_step_tokens_for(150_000_000_000, 4096, 5) / 2, abs=1)
    with pytest.raises(ValueError, match="whole_step_tokens"):
        ObjectiveOptions(whole_step_tokens=-1)


@pytest.mark.parametrize("attention", ["blockwise", "dense"])
def test_the_masks_are_built_once_per_layer_kind_not_per_layer(
    tiny_target, tmp_path, monkeypatch, attention
):
    dcfg = draft_config_from_target(
        load_target_config(tiny_target), 3, 8, mask_token_id=255, num_features=3
    )
    kinds = ["sliding_attention", "sliding_attention", "full_attention"]  # 3 layers, 2 kinds
    dcfg = dataclasses.replace(dcfg, layer_types=kinds, sliding_window=5)
    batch = _batch(tiny_target, tmp_path, dcfg)
    built = []
    for name in ("context_seen", "dense_mask"):
        real = getattr(BlockLayout, name)
        monkeypatch.setattr(
            BlockLayout, name, lambda self, *a, _r=real, _n=name: built.append(_n) or _r(self, *a)
        )
    head = load_frozen_head(tiny_target)
    rep = _replica(DFlashDraftModel(dcfg), head, torch.float32, attention, 1 << 20)
    rep.micro_step(batch)  # one pass: blocks of every chunk through each layer once
    if attention == "blockwise":  # a context mask per chunk, for two kinds, not three layers
        assert built.count("context_seen") == 2 * len(batch.job.layout.chunks)
    else:  # the dense mask for two kinds (it reads `context_seen` itself)
        assert built.count("dense_mask") == 2
