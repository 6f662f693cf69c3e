"""The warm-up before the workers start, recorded on CPU: which planned shapes every replica
runs, on which thread and under which device (`tests/cuda` checks the compiled kernels)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from dflash_train.data.dataset import write_prepared
from dflash_train.model import block_attention, flex
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch
from dflash_train.train import models, warm_up
from dflash_train.train.setup import TrainingData
from pipeline_helpers import tiny_train_config, write_random_dataset

CPU = torch.device("cpu")


class RecordingReplica:
    """What the warm-up and the cost probe use of a `DraftReplica`; records every micro-step:
    (thread, current device scope, shape classes of the batch's chunks, rows, length)."""

    def __init__(self, device: torch.device, model: DFlashDraftModel, scope: list) -> None:
        self.device, self.model, self.scope = device, model, scope
        self.attention, self.compute_dtype, self.chunked = "flex", torch.float32, True
        self.on_policy = False
        self.feature_width = model.config.num_features * model.config.hidden_size  # ce's
        self.flat_grad = torch.ones(4)
        self.log: list[tuple] = []

    def runs_chunked(self, rows: int, blocks: int) -> bool:
        return self.chunked

    def micro_step(self, batch) -> None:
        job = batch.job
        rows, length = job.input_ids.shape
        assert batch.features.shape[:2] == (rows, length)
        self.log.append(
            (
                threading.current_thread().name,
                self.scope[-1] if self.scope else None,
                chunk_classes(job, length),
                rows,
                length,
            )
        )


def chunk_classes(job, length: int) -> frozenset:
    """The shape classes of the chunks the chunked step runs (those with targets)."""
    rows = job.input_ids.shape[0]
    b = job.layout.block_size
    run = [c for c, t in zip(job.layout.chunks, job.chunk_targets, strict=True) if len(t)]
    return frozenset(flex.shape_class(rows, hi - lo, b, length) for lo, hi, _ in run)


@pytest.fixture
def scope(monkeypatch):
    """`on_device` recorded: the device the calling thread is on (a stack)."""
    stack: list[torch.device] = []

    @contextlib.contextmanager
    def recording(device):
        stack.append(device)
        try:
            yield
        finally:
            stack.pop()

    monkeypatch.setattr(warm_up, "on_device", recording)
    monkeypatch.setattr(models, "on_device", recording)
    monkeypatch.setattr(flex, "COMPILED_DEVICE_TYPES", ("cuda", "cpu"))
    return stack


@pytest.fixture
def data(tiny_target, tmp_path):
    rows = write_random_dataset(tmp_path / "data", num_rows=48, min_len=20, max_len=200)
    cfg = tiny_train_config(
        tiny_target, rows, tmp_path / "run", num_anchors=64, attention_chunks=16, epochs=2
    )
    return cfg, TrainingData.load(cfg)


def replicas(data, scope, n=2) -> list[RecordingReplica]:
    model = DFlashDraftModel(data.draft_config)
    return [RecordingReplica(torch.device("cpu", i), model, scope) for i in range(n)]


def planned(data, epochs: int) -> list:
    return [data.builder.build(s) for e in range(epochs) for s in data.plans.epoch(e)]


def test_every_replica_runs_every_planned_class_on_the_main_thread_on_its_device(data, scope):
    cfg, d = data
    reps = replicas(d, scope)
    warm_up.warm_up(reps, d.plans, d.builder, cfg.run.epochs, lambda _m: None)
    want = set().union(*(chunk_classes(j, j.input_ids.shape[1]) for j in planned(d, 2)))
    assert len(want) >= 3  # rows of 1, chunks of 1 block, keys in one tile or more
    for rep in reps:
        assert rep.log, "the replica was never warmed up"
        assert {thread for thread, *_ in rep.log} == {"MainThread"}
        assert {device for _, device, *_ in rep.log} == {rep.device}
        assert set().union(*(classes for _, _, classes, *_ in rep.log)) == want
        assert not rep.flat_grad.any()  # a warm-up trains nothing


@pytest.fixture
def flex_calls(monkeypatch, scope):
    """Every flex call a real replica makes: (thread, device scope, `FlexKernel.key`), computed
    by the blockwise kernel (flex has no backward on CPU)."""
    log: list[tuple] = []

    def recording(q, k_ctx, v_ctx, k_blk, v_blk, layout, window, causal):
        k = torch.cat([k_ctx, k_blk], dim=2)
        key = flex.FlexKernel.key(q, k, layout.context_limits, window, causal)
        log.append((threading.current_thread().name, scope[-1] if scope else None, key))
        return block_attention._blockwise(q, k_ctx, v_ctx, k_blk, v_blk, layout, window, causal)

    monkeypatch.setattr(block_attention, "_flex", recording)
    return log


@pytest.mark.parametrize(("chunked", "whole_tokens"), [(True, 0), (False, 0), (True, 512)])
def test_the_warm_up_runs_every_flex_class_the_planned_batches_call(
    tiny_target, tmp_path, flex_calls, chunked, whole_tokens
):
    # Rows whose answers (their anchors) are short or long whatever their length: batches of
    # 16, 32 and 64 blocks of 8, over 4 anchor chunks 32, 64 and 128 queries per chunk (128,
    # 256 and 512 for the whole batch), with keys in one tile of the block mask and more.
    rng = np.random.default_rng(0)
    data = []
    for n in rng.integers(30, 250, 40):
        mask = np.zeros(n, np.uint8)
        mask[n - min(n - 2, int(rng.integers(8, 90))) :] = 1  # the prompt, then the answer
        data.append((rng.integers(0, 250, n), mask))
    write_prepared(tmp_path / "data", data)
    cfg = tiny_train_config(
        tiny_target, tmp_path / "data", tmp_path / "run", num_anchors=64, attention_chunks=4,
        drafter_devices=["cpu"], attention="blockwise", chunked_step=chunked,
        whole_step_tokens=whole_tokens,
    )  # fmt: skip
    d = TrainingData.load(cfg)
    (rep,) = models.build_replicas(cfg, d, [CPU], 10, StageTimers())
    rep.attention = "flex"  # the calls recorded above, from the replica's real micro-step
    warm_up.warm_up([rep], d.plans, d.builder, 1, lambda _m: None)
    assert {(thread, device) for thread, device, _ in flex_calls} == {("MainThread", CPU)}
    warmed = {key for *_, key in flex_calls}
    flex_calls.clear()
    width = d.draft_config.num_features * d.draft_config.hidden_size
    for job in planned(d, 1):
        rep.micro_step(HSBatch(job, torch.zeros(*job.input_ids.shape, width)))
    called = {key for *_, key in flex_calls}
    assert called <= warmed, f"never warmed up: {called - warmed}"
    if whole_tokens:  # batches within 512 block tokens ran whole, the others chunked
        assert {j.block_ids.numel() <= whole_tokens for j in planned(d, 1)} == {True, False}
        return
    # The plan holds calls on both sides of a line torch guards on: fewer than and exactly 128
    # queries (the CUDA lowering's), or 128 and more (one tile of the block mask).
    queries = {(short, one_tile) for *_, short, one_tile, _ in called}
    want = {(True, True), (False, True)} if chunked else {(False, True), (False, False)}
    assert queries == want


def test_with_compile_every_bucket_runs_its_largest_planned_batch_and_a_one_row_one(data, scope):
    # torch specialises a size of 1: tracing one row per bucket leaves every multi-row batch
    # to a recompile (or, with eager_on_recompile, to eager code) on every device.
    cfg, d = data
    (rep,) = replicas(d, scope, n=1)
    rep.attention = "blockwise"  # only --compile makes this replica trace anything
    warm_up.warm_up([rep], d.plans, d.builder, cfg.run.epochs, lambda _m: None, True)
    ran = {(length, rows) for *_, rows, length in rep.log}
    for length in d.bucket_lengths:
        rows = [len(s.seq_ids) for e in range(2) for s in d.plans.epoch(e)
                if d.bucket_lengths[s.bucket] == length]  # fmt: skip
        if rows:
            assert (length, max(rows)) in ran
            assert (1 in rows) == ((length, 1) in ran)


def test_nothing_is_warmed_up_when_nothing_compiles(data, scope):
    cfg, d = data
    (rep,) = replicas(d, scope, n=1)
    rep.attention = "blockwise"
    warm_up.warm_up([rep], d.plans, d.builder, cfg.run.epochs, lambda _m: None)
    assert rep.log == []


def test_the_cost_probe_runs_under_the_replicas_own_device(data, scope):
    _, d = data
    rep = replicas(d, scope)[1]
    models.measure_batch_cost(rep, d)
    assert rep.log and {device for _, device, *_ in rep.log} == {rep.device}


def test_the_target_compiles_under_its_own_device(data, scope):
    _, d = data

    class Target:
        device = torch.device("cpu", 3)

        def compile(self, lengths):
            self.seen = scope[-1] if scope else None

    target = Target()
    models.compile_extractors([target], d, lambda _m: None)
    assert target.seen == target.device


def test_a_compile_that_fails_in_the_warm_up_is_one_line_naming_the_device_and_the_way_out(
    data, scope
):
    class Lowering(torch._dynamo.exc.TorchDynamoException):
        pass

    cfg, d = data
    rep = replicas(d, scope)[1]

    def fail(batch):
        raise Lowering("LoweringException: flex_attention\n  target: ...")

    rep.micro_step = fail
    with pytest.raises(ValueError, match=r"on cpu:1 \(Lowering: LoweringException: flex_atten"):
        warm_up.warm_up([rep], d.plans, d.builder, cfg.run.epochs, lambda _m: None)
    with pytest.raises(ValueError, match="--attention blockwise or no --compile"):
        warm_up.warm_up([rep], d.plans, d.builder, cfg.run.epochs, lambda _m: None, True)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_on_policy_rounds_run_only_flex_classes_the_warm_up_traced(
    tiny_target, tmp_path, flex_calls, arch
):
    # With on-policy anchors the blocks a batch trains are the drafter's own rounds: how many
    # there are per row (and so per anchor chunk) is known only at the step, whatever the
    # plan. Every class such a batch could call, with and without gradients (the rounds'
    # parallel forward runs without), must be traced before the workers start.
    rng = np.random.default_rng(1)
    data = []
    for n in rng.integers(24, 200, 30):
        mask = np.zeros(n, np.uint8)
        mask[n - min(n - 2, int(rng.integers(2, 120))) :] = 1  # responses of 2-120 tokens
        data.append((rng.integers(0, 250, n), mask))
    write_prepared(tmp_path / "data", data)
    cfg = tiny_train_config(
        tiny_target, tmp_path / "data", tmp_path / "run", num_anchors=64, attention_chunks=8,
        drafter_devices=["cpu"], attention="blockwise", anchors="on-policy", arch=arch,
    )  # fmt: skip
    d = TrainingData.load(cfg)
    (rep,) = models.build_replicas(cfg, d, [CPU], 10, StageTimers())
    rep.attention = "flex"
    warm_up.warm_up([rep], d.plans, d.builder, 1, lambda _m: None)
    warmed = {key for *_, key in flex_calls}
    flex_calls.clear()
    width = rep.feature_width
    for seed in range(2):  # other features, other drafts, other rounds
        gen = torch.Generator().manual_seed(seed)
        for job in planned(d, 1):
            features = torch.randn(*job.input_ids.shape, width, generator=gen)
            rep.micro_step(HSBatch(job, features))
    called = {key for *_, key in flex_calls}
    assert {grad for _, _, grad, *_ in called} == {True, False}
    assert called <= warmed, f"never warmed up: {called - warmed}"


def test_the_round_calls_hold_every_class_any_block_count_falls_in(data):
    cfg, d = data
    calls = warm_up.round_calls(d.plans, d.builder, cfg.run.epochs)
    b = d.builder.block_size
    have = {flex.shape_class(rows, n, b, length) for rows, length, n in calls}
    assert len(have) == len(calls)  # one call per class
    shapes = {(len(s.seq_ids), d.bucket_lengths[s.bucket]) for s in d.plans.epoch(0)}
    for rows, length in shapes:
        for n in range(1, 600):
            assert flex.shape_class(rows, n, b, length) in have, (rows, length, n)
