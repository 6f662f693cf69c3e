"""The models a run trains with: one drafter replica per drafter device (all from one seeded
initialisation, or all from a checkpoint) and one frozen target per target device."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import numpy as np
import torch

from dflash_train.config import TrainConfig
from dflash_train.data.buckets import BatchSpec
from dflash_train.devices import on_device, resolve_dtype
from dflash_train.model.checkpoint import init_from_draft
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import TargetFeatureExtractor, load_frozen_head
from dflash_train.pipeline.costing import CostFit, ProbeShape, measure_drafter_cost, probe_shapes
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.checkpoint import ResumePoint, restore_optimizer
from dflash_train.train.replica import DraftReplica
from dflash_train.train.setup import TrainingData


def build_replicas(
    cfg: TrainConfig,
    data: TrainingData,
    devices: list[torch.device],
    total_steps: int,
    timers: StageTimers,
    resume: ResumePoint | None = None,
) -> list[DraftReplica]:
    """Identical drafter copies, one per device: seeded (then, with --init-from, a trained
    drafter's weights), or the checkpoint's weights, optimizer moments and step."""
    torch.manual_seed(cfg.run.seed)
    model = DFlashDraftModel(data.draft_config)
    model.init_weights(seed=cfg.run.seed)
    if cfg.model.init_from and resume is None:  # a resumed run has its own trained weights
        init_from_draft(model, cfg.model.init_from)
    if resume is not None:
        missing, unexpected = model.load_state_dict(resume.weights, strict=False)
        missing = [k for k in missing if not k.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(
                f"{resume.path}: the weights do not fit the drafter (missing {missing[:4]}, "
                f"unexpected {unexpected[:4]})"
            )
    head = load_frozen_head(cfg.model.target, cfg.model.trust_remote_code)
    replicas = []
    for dev in devices:
        rep = DraftReplica(
            copy.deepcopy(model),
            head,
            dev,
            resolve_dtype(cfg.model.dtype, dev),
            cfg.objective,
            cfg.optim,
            total_steps,
            timers,
        )
        if resume is not None:
            restore_optimizer(rep.model, rep.optimizer, resume.optimizer)
            rep.step = resume.step
        replicas.append(rep)
    return replicas


def build_extractors(
    cfg: TrainConfig, data: TrainingData, devices: list[torch.device]
) -> list[TargetFeatureExtractor]:
    """Targets are loaded one device at a time, before any thread starts."""
    m = cfg.model
    ids = data.draft_config.target_layer_ids
    return [
        TargetFeatureExtractor(m.target, ids, dev, resolve_dtype(m.dtype, dev), m.trust_remote_code)
        for dev in devices
    ]


def measure_batch_cost(replica: DraftReplica, data: TrainingData) -> CostFit:
    """The drafter's measured cost per token and per block position on `replica` (see
    `pipeline.costing`), from probe batches around a full batch of the longest bucket; the
    target's features are zeros (the cost does not depend on their values)."""
    width = data.draft_config.num_features * data.draft_config.hidden_size
    last_bucket = len(data.bucket_lengths) - 1

    def make_batch(shape: ProbeShape) -> HSBatch:
        mask = np.zeros(shape.length, np.uint8)
        mask[: shape.supervised] = 1
        rows = [(np.zeros(shape.length, np.int64), mask)] * shape.rows
        spec = BatchSpec(0, 0, last_bucket, tuple(range(shape.rows)))
        job = data.builder.from_rows(spec, rows, shape.length)
        features = torch.zeros(
            shape.rows, shape.length, width, device=replica.device, dtype=replica.compute_dtype
        )
        return HSBatch(job, features)

    rule, longest = data.plans.batching, data.bucket_lengths[-1]
    rows = rule.batch_size  # the largest batch of the longest bucket the plan allows
    if rule.batch_tokens:
        rows = min(rows, max(1, rule.batch_tokens // longest))
    shapes = probe_shapes(longest, rows)
    with on_device(replica.device):  # its timing events and any trace on its own device
        return measure_drafter_cost(replica, make_batch, shapes)


def compile_extractors(
    extractors: list[TargetFeatureExtractor], data: TrainingData, say: Callable[[str], None]
) -> None:
    """torch.compile each target and trace it on every bucket length, one device at a time,
    before any worker thread starts."""
    for ex in extractors:
        t0 = time.monotonic()
        with on_device(ex.device):
            ex.compile(data.bucket_lengths)
        say(
            f"compiled the target on {ex.device} for {len(data.bucket_lengths)} bucket lengths "
            f"in {time.monotonic() - t0:.1f}s"
        )


def planned_rows(data: TrainingData, epochs: int) -> dict[int, int]:
    """The largest batch (rows) planned per bucket length over every epoch of this node."""
    rows: dict[int, int] = {}
    for e in range(epochs):
        for spec in data.plans.epoch(e):
            length = data.bucket_lengths[spec.bucket]
            rows[length] = max(rows.get(length, 0), len(spec.seq_ids))
    return rows


def capture_target_graphs(
    extractors: list[TargetFeatureExtractor],
    data: TrainingData,
    epochs: int,
    say: Callable[[str], None],
) -> None:
    """CUDA graphs of each target's forward per bucket length, one device after the other,
    before any worker thread starts. A capture that fails leaves that target eager, said once:
    graphs are a speed-up, never a reason for a run to fail."""
    rows = planned_rows(data, epochs)
    for ex in extractors:
        t0 = time.monotonic()
        before = torch.cuda.memory_reserved(ex.device)
        try:
            n = ex.capture_graphs(rows)
        except Exception as e:  # the model cannot be captured (e.g. an op that syncs)
            what = f"{type(e).__name__}: {e}"
            say(f"warning: CUDA graph capture of the target on {ex.device} failed ({what}); eager")
            continue
        gib = (torch.cuda.memory_reserved(ex.device) - before) / 2**30
        say(
            f"captured {n} CUDA graphs of the target on {ex.device} (up to "
            f"{max(rows.values())} rows) in {time.monotonic() - t0:.1f}s, {gib:.2f} GiB"
        )
