"""The models a run trains with: one drafter replica per drafter device (all from one seeded
initialisation, or all from a checkpoint) and one frozen target per target device."""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_train.config import ENGINE_ONLY, EngineOptions, TrainConfig
from dflash_train.data.buckets import BatchSpec
from dflash_train.devices import on_device, resolve_dtype
from dflash_train.engine.source import (
    VllmTarget,
    VllmTargetSettings,
    largest_batch_tokens,
    open_engines,
)
from dflash_train.model.checkpoint import init_from_draft
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import TargetFeatureExtractor, load_frozen_head
from dflash_train.pipeline.costing import CostFit, ProbeShape, measure_drafter_cost, probe_shapes
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.stages import FeatureSource
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
    node: tuple[int, int] = (0, 1),
) -> list[DraftReplica]:
    """Identical drafter copies, one per device: seeded (then, with --init-from, a trained
    drafter's weights), or the checkpoint's weights, optimizer moments and step. Muon's
    orthogonalisation is split over every replica of every node (`node`: this node's rank and
    the node count), the same update as unsplit, bit for bit."""
    # Every global generator a checkpoint records, from the seed: the same seed then writes
    # the same checkpoint, byte for byte (none of numpy's or Python's draws what is trained).
    torch.manual_seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    random.seed(cfg.run.seed)
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
    rank, nodes = node
    for i, rep in enumerate(replicas):
        rep.split_optimizer(rank * len(replicas) + i, nodes * len(replicas))
    return replicas


def build_extractors(
    cfg: TrainConfig, data: TrainingData, devices: list[torch.device]
) -> list[TargetFeatureExtractor]:
    """Targets are loaded one device at a time, before any thread starts."""
    m = cfg.model
    ids = data.feature_layer_ids
    return [
        TargetFeatureExtractor(m.target, ids, dev, resolve_dtype(m.dtype, dev), m.trust_remote_code)
        for dev in devices
    ]


TEACHER_NOT_ON_ENGINE = (
    "the target's last hidden state, needed by {}, is not returned by the vLLM backend: use "
    "--target-backend hf, or a feature store captured with --teacher-input{}"
)
"""Formatted with what needs the teacher and a way out without it (", or train with ...")."""
REQUEST_TIMEOUT_SHARE = 0.8
"""A batch's features must arrive within this share of --stall-timeout: the worker's error
(with the engine's last log lines) then comes before the watchdog's hang report."""
ENGINE_CONTEXT_MARGIN = 16
"""Tokens of context the engine gets beyond the longest bucket (it generates one per row)."""


@dataclass
class Targets:
    """The run's feature sources, one per target worker, and the engines behind them (none: the
    hf backend's in-process extractors)."""

    sources: list[FeatureSource]
    engines: list[VllmTarget] = field(default_factory=list)

    @property
    def in_process(self) -> bool:
        return not self.engines

    def describe(self) -> str:
        return "; ".join(e.describe() for e in self.engines)

    def describe_failure(self) -> str:
        """What a hang report adds: each engine's state and last log lines ('' in process)."""
        return "; ".join(e.describe_failure() for e in self.engines)

    def close(self, keep_log: Path | None = None) -> None:
        """Stop the engine this run started (its log kept at `keep_log`); safe more than once."""
        for engine in self.engines:
            engine.close(keep_log)


def open_targets(
    cfg: TrainConfig, data: TrainingData, devices: list[torch.device], say: Callable[[str], None]
) -> Targets:
    """--target-backend hf: one in-process extractor per target device; vllm: the engine (started
    here, or --target-endpoint's) and --target-workers sources on it."""
    e = cfg.engine
    if e.target_backend == "hf":
        defaults = EngineOptions()
        unused = [
            f"--{k.replace('_', '-')}" for k in ENGINE_ONLY if getattr(e, k) != getattr(defaults, k)
        ]
        if unused:
            verb = "has" if len(unused) == 1 else "have"
            say(f"note: {', '.join(unused)} {verb} no effect with --target-backend hf")
        return Targets(list(build_extractors(cfg, data, devices)))
    if cfg.pipeline.cuda_graphs:
        raise ValueError(
            "--cuda-graphs captures the in-process target's forward (--target-backend hf); the "
            "vLLM engine captures its own CUDA graphs"
        )
    longest, batching = data.bucket_lengths[-1], data.plans.batching
    settings = VllmTargetSettings.from_options(
        e,
        cfg.model.target,
        data.draft_config.target_layer_ids,
        resolve_dtype(cfg.model.dtype, devices[0]),
        longest + ENGINE_CONTEXT_MARGIN,
        devices,
        REQUEST_TIMEOUT_SHARE * cfg.pipeline.stall_timeout,
        data.draft_config.hidden_size,
        largest_batch_tokens(batching.batch_size, batching.batch_tokens, longest),
    )
    return engine_targets(settings, e, devices, data.dataset.lengths, say)


def engine_targets(
    settings: VllmTargetSettings,
    options: EngineOptions,
    devices: list[torch.device],
    lengths: np.ndarray,
    say: Callable[[str], None],
) -> Targets:
    """The engines (`open_engines`: each --target-endpoint, or one started here) and
    --target-workers sources on them, taken in turn (default: one per target device, at least
    one per engine); `lengths` (by row id): each row's own tokens go to the engine, not its
    padding."""
    engines = open_engines(settings, options.target_endpoint, say)
    workers = options.target_workers or max(len(devices), len(engines))
    return Targets([engines[i % len(engines)].source(lengths) for i in range(workers)], engines)


def measure_batch_cost(replica: DraftReplica, data: TrainingData) -> CostFit:
    """The drafter's measured cost per token and per block position on `replica` (see
    `pipeline.costing`), from probe batches around a full batch of the longest bucket; the
    target's features are zeros (the cost does not depend on their values)."""
    width = replica.feature_width
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
