"""Where a run's features come from: the target online (default), a captured feature store
(`--features`: reader workers in the target workers' place, no target loaded anywhere), or both
(`--cache-features`: the hybrid, see `store.cache`). One function builds the stages the pipeline
runs for each; the pipeline, the queue, lockstep and resume are the same in all three."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.config import ENGINE_ONLY, EngineOptions, TrainConfig, human_bytes, parse_bytes
from dflash_train.data.buckets import assign_buckets
from dflash_train.devices import resolve_dtype
from dflash_train.model.digest import target_weights_digest
from dflash_train.model.target import TEACHER_INPUT_ID, TargetFeatureExtractor
from dflash_train.pipeline.stages import FeatureReader, FeatureSource
from dflash_train.store.cache import CachingReader, FeatureCache, rows_to_cache
from dflash_train.store.manifest import Binding, binding_problems
from dflash_train.store.reader import ReadStats, StoreReader
from dflash_train.store.store import FeatureStore, estimate
from dflash_train.train.models import TEACHER_NOT_ON_ENGINE, Targets, open_targets
from dflash_train.train.setup import TrainingData

HOST = torch.device("cpu")


@dataclass
class FeatureStages:
    """The feature side of a run: the targets loaded (compilation and CUDA graphs apply to
    them), the pipeline's feature sources and readers, and the store read or written."""

    extractors: list[TargetFeatureExtractor]
    sources: list[FeatureSource]
    readers: list[FeatureReader]
    description: str
    """The pipeline's feature stage, for the run's start-up lines."""
    targets: Targets | None = None
    """The online targets (in-process extractors or a vLLM engine), None with --features."""
    store: FeatureStore | None = None
    stats: ReadStats = field(default_factory=ReadStats)
    cache: FeatureCache | None = None
    """The hybrid's shared state (--cache-features), None otherwise."""
    _last: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)
    """stats' bytes, batches and busy seconds, and the clock, at the last `counters()`."""

    @property
    def workers(self) -> int:
        return len(self.sources) + len(self.readers)

    def counters(self) -> dict[str, float]:
        """Metrics of the reads since the last call (bytes per batch, bandwidth over the
        interval's wall time and per reader-busy second) and the rows the hybrid computed."""
        if self.store is None:
            return {}
        s, now = self.stats, time.monotonic()
        last_bytes, last_batches, last_busy, last_t = self._last
        nbytes, batches = s.bytes - last_bytes, s.batches - last_batches
        wall_s, busy_s = now - (last_t or now), s.seconds - last_busy
        self._last = (s.bytes, s.batches, s.seconds, now)
        out = {"store/bytes_read": float(s.bytes)}
        if batches:
            out["store/read_bytes_per_batch"] = nbytes / batches
            out["store/read_MiB_per_busy_s"] = nbytes / max(1e-9, busy_s) / 2**20
            if wall_s > 0:  # over the interval's wall time, all readers together
                out["store/read_MiB_per_s"] = nbytes / wall_s / 2**20
        computed = [r.rows_computed for r in self.readers if isinstance(r, CachingReader)]
        if computed:
            out["store/rows_computed"] = float(sum(computed))
        return out

    def cache_start(self) -> dict[str, int] | None:
        """What a checkpoint keeps for a resumed hybrid run (JSON: part -> rows): the rows the
        feature cache held when the run first started, which every epoch reads; None without
        --cache-features."""
        return None if self.cache is None else dict(self.cache.start)

    def resume_cache(self, start: dict[str, int] | None) -> None:
        """On --resume, before the pipeline starts: the saved `cache_start()` of the run's
        first session, so the rows its interrupted sessions committed are computed in epoch 0
        as the uninterrupted run computed them (None: a checkpoint without it, the rows held
        now are read)."""
        if self.cache is not None and start is not None:
            self.cache.restart_from(start)

    def close(self) -> None:
        """Close the store: a hybrid's being written (committed rows stay), or the one read,
        which `capture --overwrite` may replace once closed. (The targets are the trainer's to
        close: an engine's log goes to the run directory.)"""
        if self.store is not None:
            self.store.close()


def build_feature_stages(
    cfg: TrainConfig,
    data: TrainingData,
    target_devices: list[torch.device],
    drafter_devices: list[torch.device],
    say: Callable[[str], None] = print,
) -> FeatureStages:
    """The stages for `cfg`'s feature mode; every store check comes before a model loads."""
    p = cfg.pipeline
    if data.teacher and not p.features and cfg.engine.target_backend != "hf":
        o = cfg.objective
        raise ValueError(
            TEACHER_NOT_ON_ENGINE.format(o.teacher_reason, f", or train with {o.teacher_free}")
        )
    if p.features:
        unused = [
            f"--{n.replace('_', '-')}" for n in ("target_devices", "cuda_graphs") if getattr(p, n)
        ]
        e, engine_defaults = cfg.engine, EngineOptions()
        if e.target_backend != engine_defaults.target_backend:  # the store replaces the target
            unused.append(f"--target-backend {e.target_backend}")
        unused += [
            f"--{n.replace('_', '-')}"
            for n in ENGINE_ONLY
            if getattr(e, n) != getattr(engine_defaults, n)
        ]
        if unused:
            verb = "has" if len(unused) == 1 else "have"
            say(f"note: {', '.join(unused)} {verb} no effect with --features (no target runs)")
        dtype = resolve_dtype(cfg.model.dtype, drafter_devices[0])
        return _from_store(cfg, data, dtype, any(d.type == "cuda" for d in drafter_devices))
    if p.cache_features:
        return _hybrid(cfg, data, target_devices, say)
    targets = open_targets(cfg, data, target_devices, say)
    return FeatureStages(
        _in_process(targets), list(targets.sources), [], _workers_line(targets), targets
    )


def _in_process(targets: Targets) -> list[TargetFeatureExtractor]:
    """The targets compilation and CUDA graphs apply to (none on an engine)."""
    return list(targets.sources) if targets.in_process else []


def _workers_line(targets: Targets) -> str:
    where = [str(s.device) for s in targets.sources] if targets.in_process else "on the engine"
    return f"{len(targets.sources)} target workers {where}"


def wanted_binding(cfg: TrainConfig, data: TrainingData, dtype: str) -> Binding:
    """The binding of the features this run trains on (`dtype`: the store's own)."""
    return Binding(
        target_weights_digest(cfg.model.target),
        data.dataset.identity(),
        len(data.dataset),
        tuple(data.feature_layer_ids),
        data.draft_config.hidden_size,
        dtype,
    )


def open_features(cfg: TrainConfig, data: TrainingData) -> FeatureStore:
    """The --features store, checked against the run: one line for each way it does not fit,
    for a capture that did not finish, and for rows of other lengths than the data's."""
    path = cfg.pipeline.features
    store = FeatureStore.open(path)
    if cfg.run.eval_every:
        raise ValueError(
            "--eval-every decodes with the target, and --features trains without one: evaluate "
            "afterwards with `dflash-train eval`"
        )
    if data.teacher and TEACHER_INPUT_ID not in store.binding.layer_ids:
        o = cfg.objective
        raise ValueError(
            f"--features {path} holds no teacher input, needed by {o.teacher_reason}: capture "
            f"the store again with --teacher-input, or train with {o.teacher_free}"
        )
    problems = binding_problems(
        store.binding, wanted_binding(cfg, data, store.binding.dtype), subset_layers=True
    )
    if problems:
        raise ValueError(f"--features {path} does not fit this run: {'; '.join(problems)}")
    have = store.present()
    if not have.all():
        raise ValueError(
            f"--features {path} holds {int(have.sum())} of {len(have)} rows: its capture did not "
            "finish (run the same `dflash-train capture` command again to complete it)"
        )
    if not np.array_equal(store.tokens_of, data.dataset.lengths):
        raise ValueError(f"--features {path}: its rows differ in length from the data's")
    return store


def _from_store(
    cfg: TrainConfig, data: TrainingData, dtype: torch.dtype, pinned: bool
) -> FeatureStages:
    store = open_features(cfg, data)
    ids = data.feature_layer_ids
    stats = ReadStats()
    # Readers stage on the host (pinned for CUDA drafters, which copy and decode each batch on
    # their own device; without CUDA the readers decode).
    n = cfg.pipeline.num_readers
    readers = [StoreReader(store, ids, HOST, dtype, stats, pinned) for _ in range(n)]
    line = (
        f"{len(readers)} feature readers ({cfg.pipeline.features}: {store.binding.dtype}, no "
        "target loaded)"
    )
    return FeatureStages([], [], list(readers), line, None, store, stats)


def _hybrid(
    cfg: TrainConfig, data: TrainingData, devices: list[torch.device], say: Callable[[str], None]
) -> FeatureStages:
    p = cfg.pipeline
    lengths = data.dataset.lengths
    binding = wanted_binding(cfg, data, p.cache_dtype)
    # One writer per part: node k of a multi-node job writes its own (every node reads all).
    node, nodes = data.plans.node, data.plans.nodes
    store = FeatureStore.open_for_append(
        p.cache_features, binding, cfg.model.target, p.data, part=node, world=nodes
    )
    try:
        padded = np.asarray(data.bucket_lengths)[assign_buckets(lengths, data.bucket_lengths)]
        budget = None if p.cache_budget is None else parse_bytes(p.cache_budget, "cache_budget")
        plan = rows_to_cache(lengths, padded, store.bytes_per_token, budget)
        est = estimate(binding, lengths[plan.admit], store.present()[plan.admit], p.cache_features)
        if not est.fits:
            raise ValueError(
                f"--cache-features {p.cache_features} needs {human_bytes(est.bytes_left)} more "
                f"but its disk has {human_bytes(est.free)} free: give a --cache-budget"
            )
        say(f"feature cache {p.cache_features} ({p.cache_dtype}): {plan.reason}")
        cache = FeatureCache.open(store, plan.admit, lengths, p.stall_timeout)
        targets = open_targets(cfg, data, devices, say)
    except BaseException:
        store.close()
        raise
    stats = ReadStats()
    # Any online source computes the rows the store lacks (in-process or on an engine).
    readers = [
        CachingReader(
            src,
            cache,
            StoreReader(
                store, binding.layer_ids, src.device, src.dtype, stats, src.device.type == "cuda"
            ),
        )
        for src in targets.sources
    ]
    part = f", node {node} writing part {node} of {nodes}" if nodes > 1 else ""
    line = (
        f"{_workers_line(targets)} reading and filling the feature cache {p.cache_features} "
        f"({int(store.present().sum())} of {len(lengths)} rows stored{part})"
    )
    return FeatureStages(
        _in_process(targets), [], list(readers), line, targets, store, stats, cache
    )
