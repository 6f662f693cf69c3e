"""`dflash-train capture`: the target's selected-layer features of every row, into a store
(with --teacher-input also the teacher's input the losses on the target's distribution read).

    prefetchers --(job queue)--> target workers --(hidden-state queue, FIFO)--> store writer

The same `Pipeline` as training: prefetchers read and pad the rows, target workers (any
`FeatureSource`: the backend `--target-backend` names) compute the features, and a
`StoreWriter` takes the drafter's place. It appends each batch's rows to the store as it
receives them and commits them (durably) when the pipeline commits the step, so the
exactly-once accounting counts a row once it is stored. Nothing else is new here: the queue
bounds, the watchdog, the error path and the accounting line are training's.

Resumable: rows already stored are left out of the plan, so running the same command again
after an interruption (a signal, a crash, a full disk) writes every row exactly once.
Before it starts it prints the size estimate (bytes per token, total, free disk) and refuses to
start when the disk cannot hold it; `--dry-run` prints the estimate alone.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_train.config import CaptureOptions, EngineOptions, human_bytes, parse_bytes
from dflash_train.data.buckets import Batching, BatchSpec, assign_buckets, fit_bucket_lengths
from dflash_train.data.dataset import PreparedDataset
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import build, parsed_overrides
from dflash_train.devices import (
    configure_cpu_threads,
    default_cpu_threads,
    parse_devices,
    resolve_dtype,
)
from dflash_train.engine.source import VllmTargetSettings, largest_batch_tokens
from dflash_train.model.digest import target_weights_digest
from dflash_train.model.draft import check_target_layer_ids, default_target_layer_ids
from dflash_train.model.target import (
    TargetFeatureExtractor,
    feature_layer_ids,
    load_target_config,
)
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.prefetch import BatchBuilder
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.stages import FeatureSource
from dflash_train.pipeline.workers import PipelineError
from dflash_train.store.codec import encode_rows
from dflash_train.store.manifest import Binding, binding_problems
from dflash_train.store.store import FeatureStore, estimate
from dflash_train.train.models import (
    ENGINE_CONTEXT_MARGIN,
    REQUEST_TIMEOUT_SHARE,
    TEACHER_NOT_ON_ENGINE,
    engine_targets,
)

PROGRESS_EVERY_S = 10.0


# ---------------------------------------------------------------------- backends
@dataclass
class CaptureSources:
    """The target workers' feature sources, and how to release what they hold (an engine)."""

    sources: list[FeatureSource]
    close: Callable[[], None] = lambda: None
    describe_failure: Callable[[], str] | None = None
    """What a hang report adds (an engine's state and last log lines)."""


def hf_sources(
    opts: CaptureOptions,
    engine: EngineOptions,
    s: CaptureSetup,
    devices: list[torch.device],
    longest: int,
    say: Callable[[str], None],
) -> CaptureSources:
    """transformers targets, one per device, loaded one after the other (train's workers)."""
    remote = opts.trust_remote_code
    return CaptureSources(
        [
            TargetFeatureExtractor(
                opts.target, s.layer_ids, d, resolve_dtype(opts.compute_dtype, d), remote
            )
            for d in devices
        ]
    )


def vllm_sources(
    opts: CaptureOptions,
    engine: EngineOptions,
    s: CaptureSetup,
    devices: list[torch.device],
    longest: int,
    say: Callable[[str], None],
) -> CaptureSources:
    """The vLLM engines (one started here, or each of --target-endpoint's) and --target-workers
    sources on them, taken in turn, as train's `--target-backend vllm` runs them; the engine
    this capture started is stopped by `close` on every path."""
    settings = VllmTargetSettings.from_options(
        engine,
        opts.target,
        s.layer_ids,
        resolve_dtype(opts.compute_dtype, devices[0]),
        longest + ENGINE_CONTEXT_MARGIN,
        devices,
        REQUEST_TIMEOUT_SHARE * opts.stall_timeout,
        s.binding.hidden_size,
        largest_batch_tokens(opts.batch_size, opts.batch_tokens, longest),
    )
    targets = engine_targets(settings, engine, devices, s.dataset.lengths, say)
    return CaptureSources(targets.sources, targets.close, targets.describe_failure)


SourceFactory = Callable[
    [CaptureOptions, EngineOptions, "CaptureSetup", list[torch.device], int, Callable[[str], None]],
    CaptureSources,
]
BACKENDS: dict[str, SourceFactory] = {"hf": hf_sources, "vllm": vllm_sources}
"""--target-backend NAME -> the factory of its feature sources. Any `FeatureSource` (device +
token ids -> (batch, L, K * hidden)) plugs in here."""


# ---------------------------------------------------------------------- the writer stage
class StoreWriter:
    """The store writer in the drafter's place (the pipeline's `Replica` protocol): a batch's
    rows are appended in `micro_step` (their own tokens, not the padding) and committed in
    `apply`, which the pipeline calls once per step before it counts the step's rows."""

    def __init__(self, store: FeatureStore, lengths: np.ndarray) -> None:
        self.store, self.lengths = store, lengths
        self.device = torch.device("cpu")
        self.step = 0
        self.flat_grad = torch.zeros(0)  # nothing to sum: the lockstep only orders commits
        b = store.binding
        self._dtype, self._layers = b.dtype, len(b.layer_ids)

    def micro_step(self, batch: HSBatch) -> None:
        if batch.ready is not None:
            batch.ready.wait_here()  # this thread's work on the target's device follows its forward
        ids = batch.job.seq_ids
        lengths = [int(self.lengths[sid]) for sid in ids]
        # Converted on the target's device, one copy of the batch to the host.
        rows = encode_rows(batch.features, lengths, self._dtype, self._layers)
        for sid, data, n in zip(ids, rows, lengths, strict=True):
            self.store.append(int(sid), data, n)
        return None  # nothing supervised: the step carries no loss

    def apply(self, global_weight: float) -> None:
        self.store.commit()
        self.step += 1
        return None


@dataclass
class CapturePlan:
    """The batches of the rows not yet stored (the pipeline's `BatchPlan`, one epoch): each
    bucket's rows in id order, cut into batches."""

    num_rows: int
    specs: list[BatchSpec]
    epochs: int = 1

    def iter_all(self) -> Iterator[BatchSpec]:
        yield from self.specs


def plan_capture(
    lengths: np.ndarray, bucket_lengths: list[int], todo: np.ndarray, batching: Batching
) -> CapturePlan:
    """`todo` (bool per row): the rows to capture, batched by bucket."""
    bucket_of = assign_buckets(lengths, bucket_lengths)
    specs: list[BatchSpec] = []
    for b, blen in enumerate(bucket_lengths):
        rows = np.flatnonzero(todo & (bucket_of == b))
        for batch in batching.cut(rows, blen, bucket_lengths[-1]):
            specs.append(BatchSpec(0, len(specs), b, batch))
    return CapturePlan(len(lengths), specs)


# ---------------------------------------------------------------------- the command
@dataclass
class CaptureSetup:
    """What a capture writes: the data, the layers, the store's binding."""

    opts: CaptureOptions
    dataset: PreparedDataset
    layer_ids: list[int]
    binding: Binding


def setup(opts: CaptureOptions) -> CaptureSetup:
    """Everything that can be refused before a byte is written or a model loaded."""
    for name in ("target", "data", "out"):
        if not getattr(opts, name):
            raise ValueError(f"--{name} is required")
    dataset = PreparedDataset(opts.data)
    if len(dataset) == 0:
        raise ValueError(f"prepared dataset {opts.data} has no rows")
    cfg = load_target_config(opts.target, opts.trust_remote_code)
    n_layers = cfg.num_hidden_layers
    ids = opts.target_layer_ids or default_target_layer_ids(n_layers, opts.num_target_features)
    check_target_layer_ids(ids, n_layers)
    ids = feature_layer_ids(ids, opts.teacher_input)
    binding = Binding(
        target_weights_digest(opts.target),
        dataset.identity(),
        len(dataset),
        tuple(ids),
        cfg.hidden_size,
        opts.dtype,
    )
    return CaptureSetup(opts, dataset, list(ids), binding)


def stored_rows(s: CaptureSetup) -> np.ndarray | None:
    """Which rows an existing store at --out holds (None: no store there yet); a store of other
    features is refused now, unless --overwrite will replace it."""
    out = s.opts.out
    p = Path(out)
    if not p.is_dir() or not any(p.iterdir()) or s.opts.overwrite:
        return None
    store = FeatureStore.open(p)
    try:
        binding, present = store.binding, store.present()
    finally:
        store.close()  # its reader's hold would refuse nothing here, but is not kept
    problems = binding_problems(binding, s.binding)
    if binding.dtype != s.binding.dtype:
        problems.append(f"it holds {binding.dtype}, not {s.binding.dtype}")
    if problems:
        raise ValueError(
            f"feature store {out} holds other features: {'; '.join(problems)} (give another "
            "directory, or --overwrite to replace it)"
        )
    return present


def run_capture(
    opts: CaptureOptions, say: Callable[[str], None], engine: EngineOptions | None = None
) -> dict[str, object]:
    """Estimate, refuse what cannot fit, then capture the rows not yet stored; a summary.
    `engine`: what computes the features (`--target-backend`; default: hf)."""
    engine = engine or EngineOptions()
    if opts.teacher_input and engine.target_backend != "hf":
        raise ValueError(TEACHER_NOT_ON_ENGINE.format("--teacher-input", ""))
    s = setup(opts)
    lengths = s.dataset.lengths
    present = stored_rows(s)
    est = estimate(s.binding, lengths, present, opts.out)
    say(est.describe(s.binding))
    if opts.dry_run:
        return {"dry_run": True, "bytes_per_token": est.bytes_per_token, "bytes": est.bytes_left}
    if not est.fits:
        raise ValueError(
            f"the feature store needs {human_bytes(est.bytes_left)} but {opts.out}'s disk has "
            f"{human_bytes(est.free)} free: free some space, choose another --out, or a "
            "smaller --dtype"
        )
    store = FeatureStore.open_for_append(
        opts.out, s.binding, opts.target, opts.data, opts.overwrite, parse_bytes(opts.shard_bytes)
    )
    try:
        return _capture(s, engine, store, say)
    finally:
        store.close()


def _capture(
    s: CaptureSetup, engine: EngineOptions, store: FeatureStore, say: Callable[[str], None]
) -> dict:
    opts, lengths = s.opts, s.dataset.lengths
    done = store.present()
    if done.all():
        say(f"feature store {opts.out} already holds all {len(done)} rows")
        return _summary(store, 0, 0.0)
    buckets = fit_bucket_lengths(lengths, opts.num_buckets)
    batching = Batching(opts.batch_size, opts.batch_tokens)
    plan = plan_capture(lengths, buckets, ~done, batching)
    devices = parse_devices(opts.target_devices or _default_target(), "target_devices")
    configure_cpu_threads(opts.cpu_threads or default_cpu_threads(len(devices) + 1))
    made = BACKENDS[engine.target_backend](opts, engine, s, devices, max(buckets), say)
    try:
        pipeline = _pipeline(s, plan, buckets, made, store, say)
        pipeline.accounting.restore(done[None, :])  # stored by an earlier session: counted once
        say(
            f"capturing {int((~done).sum())} rows in {len(plan.specs)} batches with "
            f"{len(made.sources)} target workers ({engine.target_backend}) on "
            f"{', '.join(map(str, devices))} into {opts.out}"
        )
        t0 = time.monotonic()
        try:
            pipeline.start()
            _watch(pipeline, store, say)
        except PipelineError as e:
            raise _user_error(e, store) from e
        finally:
            left = pipeline.shutdown(timeout_s=60.0)
            if left:
                say(f"warning: worker threads did not exit: {left}")
    finally:
        made.close()  # after the pipeline: no worker waits on the engine now
    line = _accounting_line(pipeline, len(lengths))
    say(line)
    if not store.present().all() or "PROBLEMS" in line:
        raise RuntimeError(line)
    return _summary(store, int((~done).sum()), time.monotonic() - t0)


def _pipeline(
    s: CaptureSetup,
    plan: CapturePlan,
    buckets: list[int],
    made: CaptureSources,
    store: FeatureStore,
    say: Callable[[str], None],
) -> Pipeline:
    opts = s.opts
    settings = PipelineSettings(
        total_steps=len(plan.specs),
        num_prefetchers=opts.num_prefetchers,
        hs_queue_depth=opts.queue_depth,
        hs_min_ready=1,
        mix="fifo",
        stall_timeout_s=opts.stall_timeout,
    )
    # Anchors are the drafter's business: one per row keeps the prefetchers' host work small.
    builder = BatchBuilder(
        s.dataset, buckets, block_size=2, num_anchors=1, gamma=1.0, mask_token_id=0, seed=0
    )
    writer = StoreWriter(store, s.dataset.lengths)
    feed = TargetFeed(plan, builder, made.sources)
    return Pipeline(settings, feed, [writer], log=say, describe_stall=made.describe_failure)


def _watch(pipeline: Pipeline, store: FeatureStore, say: Callable[[str], None]) -> None:
    """Until the writer is done: a progress line every PROGRESS_EVERY_S; errors re-raised."""
    t0, total = time.monotonic(), len(store.present())
    while not pipeline.wait(PROGRESS_EVERY_S):
        stored = int(store.present().sum())
        say(f"  {stored} of {total} rows stored ({time.monotonic() - t0:.0f} s)")


def _accounting_line(pipeline: Pipeline, rows: int) -> str:
    acc = pipeline.accounting
    t = acc.totals()
    problems = acc.problems(complete=True)
    return (
        f"capture accounting: {t['read']} rows read, {t['target']} processed by targets, "
        f"{t['trained']} stored (expected {rows})"
        + ("; PROBLEMS: " + "; ".join(problems) if problems else "; all match")
    )


def _user_error(err: PipelineError, store: FeatureStore) -> Exception:
    """A full disk is the user's to fix, and the capture resumes: one line saying so."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            stored = int(store.present().sum())
            return ValueError(
                f"no space left on the device ({cause}); {stored} of {len(store.present())} rows "
                "are stored: free some space and run the same command again to continue"
            )
        cause = cause.__cause__
    return err


def _summary(store: FeatureStore, written: int, seconds: float) -> dict[str, object]:
    tokens = int(store.tokens_of.sum())
    return {
        "store": str(store.path),
        "rows": int(store.present().sum()),
        "tokens": tokens,
        "bytes": store.stored_bytes(),
        "shards": len(store.manifest.shards),
        "dtype": store.binding.dtype,
        "layer_ids": list(store.binding.layer_ids),
        "rows_written_now": written,
        "seconds": round(seconds, 1),
    }


def _default_target() -> list[str]:
    return ["cuda:0"] if torch.cuda.is_available() else ["cpu"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, CaptureOptions, title="capture options")
    add_dataclass_arguments(parser, EngineOptions, title="target backend (as train's)")


def main(args: argparse.Namespace) -> int:
    opts = build(CaptureOptions, parsed_overrides(args, CaptureOptions))
    engine = build(EngineOptions, parsed_overrides(args, EngineOptions))
    summary = run_capture(opts, lambda msg: print(msg, file=sys.stderr, flush=True), engine)
    print(json.dumps(summary, indent=2))
    return 0
