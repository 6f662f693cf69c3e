"""`bench dispatch`: the operations a drafter micro-step dispatches, counted by phase, the same
at every width, and held under a bound at the Qwen3-8B drafter's structure."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_train.bench import dispatch
from dflash_train.bench.dispatch import FLEX_LAUNCHES, PHASES, Shape, build, count_step
from dflash_train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

BEFORE_MICRO_STEP_OPS = 16_230
"""Forward, loss and backward of one micro-step at `Shape()` (flex modelled, bf16) before the
cuts (main at 3f403e5: autocast per anchor chunk, every micro-batch chunked, 64 MiB loss
chunks), from this counter run on main's code (docs/measurements/dispatch.md)."""
AFTER_MICRO_STEP_OPS = 2_424
"""The same count after them."""
BF16 = torch.bfloat16
SMALL = Shape(batch_size=2, seq_len=512, num_anchors=128, sliding_window=64)
"""The 8B drafter's layers, kinds and chunks over a shorter batch (fast): 4096 block tokens, in
one pass unless `whole_step_tokens` says otherwise."""


def _count(shape: Shape, attention: str = "flex", dtype=torch.bfloat16, arch: str = "dflash"):
    replica, batch = build(shape, attention, dtype, arch)
    return count_step(replica, batch, attention)


@pytest.mark.parametrize("whole_step_tokens", [0, None])
def test_the_count_does_not_change_with_the_width(whole_step_tokens):
    shape = dataclasses.replace(SMALL, whole_step_tokens=whole_step_tokens)
    narrow = _count(dataclasses.replace(shape, head_dim=2))
    wide = _count(dataclasses.replace(shape, head_dim=4))
    assert narrow.total() > 1000
    assert narrow.counts == wide.counts


def test_every_phase_is_counted_and_flex_launches_per_layer_and_pass():
    # 2 x 128 blocks of 16 = 4096 block tokens: one pass above the bound, 8 chunks at 0.
    layers = SMALL.draft_layers
    name = "flex_attention (compiled, modelled)"
    for tokens, passes in ((0, SMALL.attention_chunks), (4096, 1)):
        counter = _count(dataclasses.replace(SMALL, whole_step_tokens=tokens))
        assert all(counter.total(p) > 0 for p in PHASES)
        assert counter.counts["forward", name] == layers * passes * FLEX_LAUNCHES["forward"]
        back = counter.counts["backward", "flex_attention_backward (compiled, modelled)"]
        assert back == layers * passes * FLEX_LAUNCHES["backward"]
        # The loss's own operations are the loss phase's, not the forward's.
        assert counter.counts["loss", "logsumexp.default"] > 0
        assert counter.counts["forward", "logsumexp.default"] == 0


def test_the_8b_micro_step_dispatches_under_a_third_of_before():
    counter = _count(Shape())
    micro = sum(counter.total(p) for p in PHASES[:3])
    assert micro <= BEFORE_MICRO_STEP_OPS / 3
    assert micro <= AFTER_MICRO_STEP_OPS * 1.05, f"{micro} ops: regressed past the bound"


def test_the_command_prints_phases_and_operations(capsys, tmp_path):
    out = tmp_path / "d.json"
    args = ["bench", "dispatch", "--seq-len", "512", "--num-anchors", "64", "--batch-size", "1"]
    assert main([*args, "--top", "3", "--no-feeding", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "micro-step" in text and "op " in text
    data = json.loads(out.read_text())
    assert data["micro_step_ops"] > 0 and len(data["rows"]) == 6 + 3


def test_one_process_feeds_as_many_drafters_as_fit_their_host_time_in_a_gpu_step():
    counter = dispatch.DispatchCounter()
    counter.counts["forward", "mm.default"] = 3000
    counter.counts["forward", "view.default"] = 1000
    counter.views["forward"] = 1000
    # 4000 ops x 10 us + 3000 kernel ops x the launch: 55 ms a step on the host.
    host = 4000 * 10e-6 + 3000 * dispatch.LAUNCH_S
    fed = dispatch.feeding(counter, 10e-6, gpu_step_s=7.5 * host)
    assert fed["host_ms_per_step"] == pytest.approx(host * 1e3)
    assert fed["drafters_one_process_feeds"] == 7
    starved = dispatch.feeding(counter, 10e-6, gpu_step_s=0.5 * host)
    assert starved["drafters_one_process_feeds"] == 0


def test_the_gpu_step_is_bench_scales_model_of_the_8b_drafter():
    from dflash_train.bench.step import step_flops

    shape = Shape()
    real = dataclasses.replace(shape, head_dim=128, vocab_size=151936)
    cfg, _ = dispatch.scaled_config(real)  # scaled back to the real widths
    assert cfg.hidden_size == 4096 and cfg.intermediate_size == 12288
    flops = step_flops(cfg, 4, 3072, 512, 4 * 512 * 15)
    want = flops / (dispatch.PEAK_FLOPS * dispatch.DRAFTER_MFU)
    assert dispatch.gpu_step_seconds(shape) == pytest.approx(want, rel=1e-3)


def test_a_pass_saves_what_its_blocks_need_one_chunk_or_all():
    passes = {}
    for tokens in (0, None):
        replica, batch = build(dataclasses.replace(SMALL, whole_step_tokens=tokens), "flex", BF16)
        passes[tokens] = count_step(replica, batch, "flex", saved=True).saved_per_pass
    assert len(passes[0]) == SMALL.attention_chunks and len(passes[None]) == 1
    # The whole batch's blocks at once hold several chunks' activations (not all 8: the
    # context path and the weights' casts are saved once either way).
    assert max(passes[None]) > 3 * max(passes[0])
