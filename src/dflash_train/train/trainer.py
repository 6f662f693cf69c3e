"""The training run: build everything from a `TrainConfig`, run the pipeline, save, close.

    build() -> run() -> [watch the pipeline -> finish] -> close()   (close on every path)

The pipeline (`dflash_train.pipeline`) moves batches and gradients; this module owns what makes
it training: the drafter replicas and targets it runs, the schedule length, the run directory,
metrics, in-loop evaluation and checkpoints. The main thread only watches: it turns rank 0's
step records into metric lines (the only host syncs), and re-raises the first worker error.
Every path that ends a run (success, a worker error, an accounting problem, Ctrl-C) saves the
weights trained so far and closes the metric sinks, the telemetry and every pipeline thread.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.config import TrainConfig
from dflash_train.data.buckets import BatchSpec
from dflash_train.devices import (
    configure_cpu_threads,
    default_cpu_threads,
    default_devices,
    resolve_dtype,
)
from dflash_train.metrics.logger import MetricsLogger
from dflash_train.metrics.telemetry import GpuTelemetry
from dflash_train.model.checkpoint import FINAL_CHECKPOINT
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import TargetFeatureExtractor, load_frozen_head
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed, build_pipeline
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.sync import StepOutcome
from dflash_train.train.checkpoint import save_checkpoint
from dflash_train.train.in_loop_eval import InLoopEval
from dflash_train.train.replica import DraftReplica, compile_layers
from dflash_train.train.reporting import RunReporter
from dflash_train.train.run_dir import check_run_dir, prepare_run_dir
from dflash_train.train.setup import TrainingData
from dflash_train.train.step_records import EvalRecord, StepRecord, StepRecords

SinkFactory = Callable[[Path, dict[str, Any]], MetricsLogger]


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    complete: bool
    accounting: str
    last_metrics: dict[str, float]
    wall_s: float


class Trainer:
    """Owns one training run. `run()` returns a `TrainResult` or raises the first failure."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        sink_factory: SinkFactory | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.sink_factory = sink_factory
        self.pipeline: Pipeline | None = None
        self.reporter: RunReporter | None = None
        self._saved_final = False

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Everything that can fail on bad input, then the run directory and the sinks."""
        cfg = self.cfg
        if not cfg.model.target:
            raise ValueError("--target is required (a Hugging Face model directory)")
        check_run_dir(cfg.run.out, cfg.run.overwrite)
        self.data = TrainingData.load(cfg)
        p = cfg.pipeline
        self.target_devices, self.drafter_devices = default_devices(
            p.target_devices, p.drafter_devices
        )
        self.total_steps = self._total_steps()
        ncpu = sum(d.type == "cpu" for d in (*self.target_devices, *self.drafter_devices))
        self.cpu_threads = p.cpu_threads or default_cpu_threads(ncpu)
        self.timers = StageTimers()  # every stage's seconds, the replicas' device stages too
        self.replicas = self._build_replicas()
        self.extractors = self._build_extractors()
        if p.compile:
            self._compile_replicas()
        self.evaluator = self._build_evaluator()
        self.pipeline = build_pipeline(
            self._pipeline_settings(),
            TargetFeed(self.data.plans, self.data.builder, self.extractors),
            self.replicas,
            listener=self,
            log=self.say,
            timers=self.timers,
        )
        self.records = StepRecords(cfg.run.log_every, self.pipeline.stop_event)
        resolved = self._resolved_config()
        self.run_dir = prepare_run_dir(cfg.run.out, cfg.run.overwrite, resolved)
        self.reporter = self._build_reporter(resolved)

    def _build_reporter(self, resolved: dict[str, Any]) -> RunReporter:
        assert self.pipeline is not None
        gpus = {d.index for d in (*self.target_devices, *self.drafter_devices) if d.type == "cuda"}
        reporter = RunReporter(
            self.pipeline,
            total_steps=self.total_steps,
            log_every=self.cfg.run.log_every,
            num_rows=len(self.data.dataset),
            num_targets=len(self.extractors),
            progress=self.cfg.metrics.progress,
            say=self.say,
            telemetry=GpuTelemetry(sorted(gpus)),
        )
        if self.sink_factory is not None:
            try:
                reporter.sink = self.sink_factory(self.run_dir, resolved)
            except BaseException:
                reporter.close()  # the telemetry opened above
                raise
        return reporter

    def _total_steps(self) -> int:
        r = self.cfg.run
        batches = self.data.plans.batches_per_epoch() * r.epochs
        per_step = len(self.drafter_devices) * self.cfg.optim.grad_accum
        data_steps = math.ceil(batches / per_step)
        return min(data_steps, r.max_steps) if r.max_steps else data_steps

    def _build_replicas(self) -> list[DraftReplica]:
        """One drafter copy per device, all from the same seeded initialisation."""
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)
        model = DFlashDraftModel(self.data.draft_config)
        model.init_weights(seed=cfg.run.seed)
        head = load_frozen_head(cfg.model.target, cfg.model.trust_remote_code)
        return [
            DraftReplica(
                copy.deepcopy(model),
                head,
                dev,
                resolve_dtype(cfg.model.dtype, dev),
                cfg.objective,
                cfg.optim,
                self.total_steps,
                self.timers,
            )
            for dev in self.drafter_devices
        ]

    def _build_extractors(self) -> list[TargetFeatureExtractor]:
        """Targets are loaded one device at a time, before any thread starts."""
        m = self.cfg.model
        ids = self.data.draft_config.target_layer_ids
        return [
            TargetFeatureExtractor(
                m.target, ids, dev, resolve_dtype(m.dtype, dev), m.trust_remote_code
            )
            for dev in self.target_devices
        ]

    def _compile_replicas(self) -> None:
        """torch.compile each replica and trace it on a warm-up batch, one device at a time,
        before any worker thread starts (threads then only run compiled code)."""
        last = len(self.data.bucket_lengths) - 1
        length = self.data.bucket_lengths[last]
        rows = [(np.zeros(length, np.int64), np.ones(length, np.uint8))]
        job = self.data.builder.from_rows(BatchSpec(0, 0, last, (0,)), rows)
        cfg = self.data.draft_config
        width = cfg.num_features * cfg.hidden_size
        for rep in self.replicas:
            t0 = time.monotonic()
            compile_layers(rep.model)
            features = torch.zeros(1, length, width, device=rep.device, dtype=rep.compute_dtype)
            rep.micro_step(HSBatch(job, features))
            rep.flat_grad.zero_()
            self.say(f"compiled the drafter on {rep.device} in {time.monotonic() - t0:.1f}s")

    def _build_evaluator(self) -> InLoopEval | None:
        m, r = self.cfg.model, self.cfg.run
        if not r.eval_every:
            if r.eval_prompts:
                self.say("note: --eval-prompts has no effect without --eval-every")
            return None
        dev = self.drafter_devices[0]
        return InLoopEval(r, m.target, dev, resolve_dtype(m.dtype, dev), m.trust_remote_code)

    def _pipeline_settings(self) -> PipelineSettings:
        p, r = self.cfg.pipeline, self.cfg.run
        return PipelineSettings(
            total_steps=self.total_steps,
            grad_accum=self.cfg.optim.grad_accum,
            num_prefetchers=p.num_prefetchers,
            job_queue_depth=p.job_queue_depth,
            hs_queue_depth=p.hs_queue_depth,
            hs_min_ready=p.hs_min_ready,
            hs_queue_bytes=p.hs_queue_max_bytes,
            mix=p.mix,
            bucket_weights=self.data.weights,
            stall_timeout_s=p.stall_timeout,
            seed=r.seed,
        )

    def _resolved_config(self) -> dict[str, Any]:
        resolved = self.cfg.to_dict()
        resolved["resolved"] = {
            "bucket_lengths": self.data.bucket_lengths,
            "target_devices": [str(d) for d in self.target_devices],
            "drafter_devices": [str(d) for d in self.drafter_devices],
            "draft": self.data.draft_config.to_dict(),
            "mask_token_choice": self.data.mask_how,
        }
        return resolved

    def describe(self) -> str:
        p, r, d = self.cfg.pipeline, self.cfg.run, self.data
        nparams = sum(x.numel() for x in self.replicas[0].params)
        qbytes = p.hs_queue_bytes or "unbounded"
        dc = d.draft_config
        return "\n".join(
            [
                f"run dir: {self.run_dir}",
                f"data: {len(d.dataset)} sequences, buckets {d.bucket_lengths}, "
                f"{d.plans.batches_per_epoch()} batches/epoch x {r.epochs} epochs -> "
                f"{self.total_steps} optimizer steps",
                f"drafter: {dc.num_hidden_layers} layers, {nparams / 1e6:.2f}M trainable params, "
                f"block {dc.block_size}, target layers {dc.target_layer_ids}, mask id "
                f"{dc.mask_token_id} ({d.mask_how}), attention {self.replicas[0].attention}",
                f"pipeline: {p.num_prefetchers} prefetchers -> job queue (depth "
                f"{p.job_queue_depth}) -> {len(self.extractors)} target workers "
                f"{[str(x) for x in self.target_devices]} -> hidden-state queue (depth "
                f"{p.hs_queue_depth}, min_ready {p.hs_min_ready}, bytes {qbytes}, mix {p.mix}; "
                f"features stay on the target device) -> {len(self.replicas)} drafter workers "
                f"{[str(x) for x in self.drafter_devices]}, lockstep",
            ]
        )

    # ------------------------------------------------------------------ run
    def run(self) -> TrainResult:
        """Start, watch until the drafters finish, account and save; close on every path."""
        t_start = time.monotonic()
        self.say(self.describe())
        try:
            configure_cpu_threads(self.cpu_threads)
            self.pipeline.start()
            step, last = self._watch()
            return self._finish(step, last, time.monotonic() - t_start)
        except BaseException:
            self._stop_pipeline(strict=False)
            self._save_after_failure()
            raise
        finally:
            self.close()

    def _watch(self) -> tuple[int, dict[str, float]]:
        """Main-thread loop until every drafter has finished: metrics, progress, errors."""
        assert self.reporter is not None
        self.reporter.start()
        while (rec := self._next_record()) is not None:
            self.reporter.add(rec)
        return self.reporter.step, self.reporter.finish()

    def _next_record(self) -> StepRecord | EvalRecord | None:
        """The next record from rank 0, or None once the drafters are done and it is drained;
        raises the first worker error."""
        while True:
            self.pipeline.check()
            rec = self.records.get(timeout=0.25)
            if rec is not None:
                return rec
            if self.pipeline.drafters_done():
                # Every put happened before its thread ended: one more look drains the queue.
                return self.records.get(timeout=0.0)

    def on_step(self, outcome: StepOutcome, grad_norm: torch.Tensor | None) -> None:
        """Rank 0's drafter thread, after each applied step: records, evaluation, checkpoints
        (the other replicas wait at the next rendezvous meanwhile)."""
        rep = self.replicas[0]
        self.records.put(StepRecord(outcome, grad_norm, rep.step, rep.lr))
        last = outcome.all_ended or rep.step >= self.total_steps
        if self.evaluator is not None and (self.evaluator.due(rep.step) or last):
            self.records.put(EvalRecord(rep.step, *self.evaluator(rep)))
        every = self.cfg.run.save_every
        if every and rep.step % every == 0:
            path = self.run_dir / "checkpoints" / f"step_{rep.step:07d}"
            self.save(path, complete=False, reason="periodic")

    # ------------------------------------------------------------------ finish, save, close
    def _finish(self, step: int, last: dict[str, float], wall_s: float) -> TrainResult:
        """The drafters are done: stop what still runs, account, save the final checkpoint."""
        self._stop_pipeline(strict=True)
        self.pipeline.check()  # an error raised while the pipeline wound down
        for rep in self.replicas:
            rep.flush_timers()
        acc = self.pipeline.accounting
        complete = acc.totals()["trained"] == len(self.data.dataset) * self.cfg.run.epochs
        line = acc.summary_line(complete)
        self.say(line)
        if complete and acc.problems(complete=True):
            self._save_final(complete=False, reason="accounting problem")
            raise RuntimeError(line)
        ckpt = self._save_final(complete, reason="finished")
        return TrainResult(self.run_dir, ckpt, step, complete, line, last, wall_s)

    def _stop_pipeline(self, strict: bool) -> None:
        """Stop the producers still running (max_steps reached, or a failure) and join every
        thread; a thread that does not exit is an error when `strict`, a warning otherwise."""
        left = self.pipeline.shutdown(timeout_s=30.0)
        if left and strict:
            raise RuntimeError(f"worker threads did not exit: {left}")
        if left:
            self.say(f"warning: worker threads did not exit: {left}")

    def save(self, path: Path, *, complete: bool, reason: str) -> Path:
        """Weights, optimizer moments and the per-epoch trained-id bitmap (for exact resume)."""
        rep = self.replicas[0]
        acc, epochs = self.pipeline.accounting, self.cfg.run.epochs
        bitmaps = [acc.trained_bitmap(e) for e in range(epochs)]
        current = next((e for e, bits in enumerate(bitmaps) if not bits.all()), epochs)
        state = {
            "step": rep.step,
            "total_steps": self.total_steps,
            "complete": complete,
            "epoch": current,
            "epochs": epochs,
            "seed": self.cfg.run.seed,
            "trained_sequences": acc.totals()["trained"],
            "reason": reason,
        }
        return save_checkpoint(
            path, rep.model, state, optimizer=rep.optimizer, trained=np.stack(bitmaps)
        )

    def _save_final(self, complete: bool, reason: str) -> Path:
        path = self.save(self.run_dir / FINAL_CHECKPOINT, complete=complete, reason=reason)
        self._saved_final = True
        self.say(f"checkpoint ({reason}, step {self.replicas[0].step}): {path}")
        return path

    def _save_after_failure(self) -> None:
        """Keep the weights trained so far; a failure to save must not hide the original error."""
        if self._saved_final:
            return
        try:
            self._save_final(complete=False, reason="interrupted or failed")
        except Exception as e:  # reported, then the original error propagates
            self.say(f"warning: could not save a checkpoint after the failure: {e}")

    def close(self) -> None:
        """Release everything the run opened: every pipeline thread, the progress line, the
        metric sinks and the telemetry. Safe on every path and more than once."""
        if self.pipeline is not None:
            self._stop_pipeline(strict=False)
        if self.reporter is not None:
            self.reporter.close()
