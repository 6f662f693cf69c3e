"""The training run: build every stage from a `TrainConfig`, start, watch, stop, account.

    prefetchers --(job queue, FIFO)--> target workers --(hidden-state queue, mixed)--> drafters

Threads: `num_prefetchers` prefetchers, one target worker per target device, one drafter per
drafter device. The main thread only watches: it turns rank 0's step outcomes into metric lines
(the only host syncs), runs the stall watchdog, and re-raises the first worker error. A clean end
is counted, never guessed: every producer signals done exactly once, the queues drain, and the
drafters' lockstep ends after the step in which every replica has seen the end of the stream.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.config import TrainConfig
from dflash_train.data.buckets import BatchSpec, bucket_weights, fit_bucket_lengths
from dflash_train.data.dataset import PreparedDataset
from dflash_train.devices import (
    configure_cpu_threads,
    default_cpu_threads,
    parse_devices,
    resolve_dtype,
)
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import TargetFeatureExtractor, draft_config_for, load_frozen_head
from dflash_train.pipeline.drafter_worker import run_drafter
from dflash_train.pipeline.monitor import Accounting, StageTimers
from dflash_train.pipeline.prefetch import BatchBuilder, EpochPlans, make_job, run_prefetcher
from dflash_train.pipeline.queue import END, BufferedHSQueue, QueueStopped
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.sync import StepOutcome, StepRendezvous
from dflash_train.pipeline.target_worker import run_target_worker
from dflash_train.pipeline.workers import WorkerGroup
from dflash_train.progress import Progress
from dflash_train.train.checkpoint import save_checkpoint
from dflash_train.train.in_loop_eval import InLoopEval
from dflash_train.train.interval import IntervalMetrics
from dflash_train.train.replica import DraftReplica, compile_layers


class MetricsSink:
    """What the run logs to (see `dflash_train.metrics`); a no-op by default."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    complete: bool
    accounting: str
    last_metrics: dict[str, float]
    wall_s: float


@dataclass
class _StepRecord:
    outcome: StepOutcome
    grad_norm: torch.Tensor | None
    step: int
    lr: float


@dataclass
class _EvalRecord:
    step: int
    tau: float
    seconds: float


def default_devices(cfg_targets: list[str] | None, cfg_drafters: list[str] | None):
    """Explicit lists win; otherwise cuda:0 for the target and the other GPUs for drafters
    (one GPU: both share it), or cpu / cpu without CUDA."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    targets = cfg_targets or (["cuda:0"] if n else ["cpu"])
    drafters = cfg_drafters or ([f"cuda:{i}" for i in range(1, n)] or ["cuda:0"] if n else ["cpu"])
    return parse_devices(targets, "target_devices"), parse_devices(drafters, "drafter_devices")


def check_run_dir(path: str | Path, overwrite: bool) -> Path:
    """Refuse a non-empty run directory unless `overwrite` (checked before any model loads)."""
    run_dir = Path(path)
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        raise ValueError(
            f"run directory {run_dir} already exists and is not empty; pass --overwrite or "
            "choose another --out"
        )
    return run_dir


def prepare_run_dir(path: str | Path, overwrite: bool) -> Path:
    """Create the run directory; with `overwrite`, drop the previous run's metrics and result
    (its checkpoints stay until replaced)."""
    run_dir = check_run_dir(path, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "result.json"):
        (run_dir / stale).unlink(missing_ok=True)
    return run_dir


class Trainer:
    """Owns one training run. `run()` returns a `TrainResult` or raises the first failure."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        sink_factory: Callable[[Path, dict[str, Any]], MetricsSink] | None = None,
        log: Callable[[str], None] | None = None,
        after_step_hooks: list[Callable[[int, DraftReplica], None]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.sink_factory = sink_factory
        self.hooks = after_step_hooks or []
        self.stop = threading.Event()
        self.group = WorkerGroup(self.stop)
        self.timers = StageTimers()

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        cfg = self.cfg
        m, p, r = cfg.model, cfg.pipeline, cfg.run
        if not m.target:
            raise ValueError("--target is required (a Hugging Face model directory)")
        if not p.data:
            raise ValueError("--data is required (a directory from `dflash-train prepare`)")
        check_run_dir(r.out, r.overwrite)
        self.dataset = PreparedDataset(p.data)
        if len(self.dataset) == 0:
            raise ValueError(f"prepared dataset {p.data} has no rows")
        self.bucket_lengths = p.bucket_lengths or fit_bucket_lengths(
            self.dataset.lengths, p.num_buckets
        )
        self.plans = EpochPlans(
            self.dataset.lengths,
            self.bucket_lengths,
            p.batch_size,
            p.batch_tokens,
            r.seed,
            r.epochs,
        )
        self.weights = bucket_weights(self.plans.epoch(0))
        self.target_devices, self.drafter_devices = default_devices(
            p.target_devices, p.drafter_devices
        )
        self.draft_config, self.mask_how = draft_config_for(m)
        # Everything that can fail on bad input happens before the run directory is created.
        self._build_workers()
        self.run_dir = prepare_run_dir(r.out, r.overwrite)
        resolved = cfg.to_dict()
        resolved["resolved"] = {
            "bucket_lengths": self.bucket_lengths,
            "target_devices": [str(d) for d in self.target_devices],
            "drafter_devices": [str(d) for d in self.drafter_devices],
            "draft": self.draft_config.to_dict(),
            "mask_token_choice": self.mask_how,
        }
        (self.run_dir / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        self.sink = (self.sink_factory or (lambda _d, _c: MetricsSink()))(self.run_dir, resolved)

    def _build_workers(self) -> None:
        cfg, m, p, r = self.cfg, self.cfg.model, self.cfg.pipeline, self.cfg.run
        ndraft = len(self.drafter_devices)
        batches = self.plans.batches_per_epoch() * r.epochs
        data_steps = math.ceil(batches / (ndraft * cfg.optim.grad_accum))
        self.total_steps = min(data_steps, r.max_steps) if r.max_steps else data_steps
        ncpu = sum(d.type == "cpu" for d in (*self.target_devices, *self.drafter_devices))
        self.cpu_threads = p.cpu_threads or default_cpu_threads(ncpu)
        torch.manual_seed(r.seed)
        model = DFlashDraftModel(self.draft_config)
        model.init_weights(seed=r.seed)
        head = load_frozen_head(m.target, m.trust_remote_code)
        self.replicas = []
        for dev in self.drafter_devices:
            rep = DraftReplica(
                copy.deepcopy(model),
                head,
                dev,
                resolve_dtype(m.dtype, dev),
                cfg.objective,
                cfg.optim,
                self.total_steps,
                self.timers,
            )
            self.replicas.append(rep)
        # Targets are loaded one device at a time, before any thread starts.
        self.extractors = [
            TargetFeatureExtractor(
                m.target,
                self.draft_config.target_layer_ids,
                dev,
                resolve_dtype(m.dtype, dev),
                m.trust_remote_code,
            )
            for dev in self.target_devices
        ]
        if p.compile:
            self._compile_replicas()
        self.builder = BatchBuilder.for_run(
            self.dataset, self.bucket_lengths, cfg.objective, self.draft_config, r.seed
        )
        self.jobs = BufferedHSQueue(
            p.job_queue_depth,
            1,
            p.num_prefetchers,
            mix="fifo",
            stop_event=self.stop,
            name="job queue",
        )
        self.hs_queue = BufferedHSQueue(
            p.hs_queue_depth,
            p.hs_min_ready,
            len(self.extractors),
            mix=p.mix,
            bucket_weights=self.weights,
            max_bytes=p.hs_queue_max_bytes,
            stop_event=self.stop,
            seed=r.seed,
            name="hidden-state queue",
        )
        self.records = BufferedHSQueue(
            4096, 1, 1, mix="fifo", stop_event=self.stop, name="step records"
        )
        self.rendezvous = StepRendezvous(
            [rep.flat_grad for rep in self.replicas], self.stop, p.stall_timeout
        )
        self.accounting = Accounting(len(self.dataset), r.epochs)
        self.evaluator = None
        if r.eval_every:
            dev0 = self.drafter_devices[0]
            self.evaluator = InLoopEval(
                r, m.target, dev0, resolve_dtype(m.dtype, dev0), m.trust_remote_code
            )
        elif r.eval_prompts:
            self.say("note: --eval-prompts has no effect without --eval-every")
        from dflash_train.metrics.telemetry import GpuTelemetry

        gpus = sorted(
            {d.index for d in (*self.target_devices, *self.drafter_devices) if d.type == "cuda"}
        )
        self.telemetry = GpuTelemetry(gpus)

    def _compile_replicas(self) -> None:
        """torch.compile each replica and trace it on a warm-up batch, one device at a time,
        before any worker thread starts (threads then only run compiled code)."""
        m = self.cfg.model
        length = self.bucket_lengths[-1]
        rows = [(np.zeros(length, np.int64), np.ones(length, np.uint8))]
        gamma = self.cfg.objective.gamma_for(m.block_size)
        job = make_job(
            BatchSpec(0, 0, len(self.bucket_lengths) - 1, (0,)),
            rows,
            length,
            block_size=m.block_size,
            num_anchors=self.cfg.objective.num_anchors,
            gamma=gamma,
            mask_token_id=self.draft_config.mask_token_id,
            seed=0,
            attention_chunks=self.cfg.objective.attention_chunks,
        )
        width = self.draft_config.num_features * self.draft_config.hidden_size
        for rep in self.replicas:
            t0 = time.monotonic()
            compile_layers(rep.model)
            features = torch.zeros(1, length, width, device=rep.device, dtype=rep.compute_dtype)
            rep.micro_step(HSBatch(job, features, 0.0))
            rep.flat_grad.zero_()
            self.say(f"compiled the drafter on {rep.device} in {time.monotonic() - t0:.1f}s")

    def describe(self) -> str:
        p, r = self.cfg.pipeline, self.cfg.run
        nparams = sum(x.numel() for x in self.replicas[0].params)
        qbytes = p.hs_queue_bytes or "unbounded"
        return "\n".join(
            [
                f"run dir: {self.run_dir}",
                f"data: {len(self.dataset)} sequences, buckets {self.bucket_lengths}, "
                f"{self.plans.batches_per_epoch()} batches/epoch x {r.epochs} epochs -> "
                f"{self.total_steps} optimizer steps",
                f"drafter: {self.draft_config.num_hidden_layers} layers, {nparams / 1e6:.2f}M "
                f"trainable params, block {self.draft_config.block_size}, target layers "
                f"{self.draft_config.target_layer_ids}, mask id {self.draft_config.mask_token_id} "
                f"({self.mask_how}), attention {self.replicas[0].attention}",
                f"pipeline: {p.num_prefetchers} prefetchers -> job queue (depth "
                f"{p.job_queue_depth}) -> {len(self.extractors)} target workers "
                f"{[str(d) for d in self.target_devices]} -> hidden-state queue (depth "
                f"{p.hs_queue_depth}, min_ready {p.hs_min_ready}, bytes {qbytes}, mix {p.mix}; "
                f"features stay on the target device) -> {len(self.replicas)} drafter workers "
                f"{[str(d) for d in self.drafter_devices]}, lockstep",
            ]
        )

    # ------------------------------------------------------------------ run
    def run(self) -> TrainResult:
        t_start = time.monotonic()
        self.say(self.describe())
        self._start_workers()
        interval = IntervalMetrics(self.weights, len(self.extractors), len(self.replicas))
        # Off a terminal, _log writes one line per log step; no timed lines in between.
        progress = Progress(
            self.total_steps,
            "train",
            enabled=self.cfg.metrics.progress,
            unit="step",
            interval_s=float("inf"),
        )
        last: dict[str, float] = {}
        step = 0
        try:
            step, last = self._watch(interval, progress)
        except BaseException:
            self._shutdown()
            self._save_after_failure()
            raise
        finally:
            progress.close()
        self._shutdown()
        leftover = self.group.alive()
        if leftover:
            raise RuntimeError(f"worker threads did not exit: {leftover}")
        if (err := self.group.first_error()) is not None:
            raise err.to_exception()
        complete = self.rendezvous_complete()
        line = self.accounting.summary_line(complete)
        self.say(line)
        if complete and self.accounting.problems(complete=True):
            raise RuntimeError(line)
        ckpt = self._save_final(step, complete, reason="finished")
        self.sink.close()
        self.telemetry.close()
        return TrainResult(
            self.run_dir, ckpt, step, complete, line, last, time.monotonic() - t_start
        )

    def rendezvous_complete(self) -> bool:
        """Whether every batch of every epoch was trained (not stopped by max_steps)."""
        totals = self.accounting.totals()
        return totals["trained"] == len(self.dataset) * self.cfg.run.epochs

    def _start_workers(self) -> None:
        p = self.cfg.pipeline
        configure_cpu_threads(self.cpu_threads)
        for rank, rep in enumerate(self.replicas):
            self.group.spawn(
                f"drafter-{rank}",
                run_drafter,
                rank,
                rep,
                self.hs_queue,
                self.rendezvous,
                self.timers,
                self.stop,
                self.total_steps,
                self.cfg.optim.grad_accum,
                self._after_step if rank == 0 else None,
                on_exit=self.records.producer_done if rank == 0 else None,
            )
        for i, ex in enumerate(self.extractors):
            self.group.spawn(
                f"target-{i}",
                run_target_worker,
                ex,
                self.jobs,
                self.hs_queue,
                self.accounting,
                self.timers,
                self.stop,
                on_exit=self.hs_queue.producer_done,
            )
        for i in range(p.num_prefetchers):
            self.group.spawn(
                f"prefetch-{i}",
                run_prefetcher,
                i,
                p.num_prefetchers,
                self.plans,
                self.builder,
                self.jobs,
                self.accounting,
                self.timers,
                self.stop,
                on_exit=self.jobs.producer_done,
            )

    def _after_step(self, outcome: StepOutcome, grad_norm: torch.Tensor | None) -> None:
        """Rank 0, after each applied step: account, hand metrics over, run hooks."""
        rep = self.replicas[0]
        for job in outcome.jobs:
            self.accounting.add("trained", job.epoch, job.seq_ids)
        self.records.put(_StepRecord(outcome, grad_norm, rep.step, rep.lr))
        last = outcome.all_ended or rep.step >= self.total_steps
        if self.evaluator is not None and (self.evaluator.due(rep.step) or last):
            self.records.put(_EvalRecord(rep.step, *self.evaluator(rep)))
        r = self.cfg.run
        if r.save_every and rep.step % r.save_every == 0:
            self._save(
                self.run_dir / "checkpoints" / f"step_{rep.step:07d}",
                self._train_state(rep.step, complete=False),
            )
        for hook in self.hooks:
            hook(rep.step, rep)

    def _watch(self, interval: IntervalMetrics, progress: Progress) -> tuple[int, dict]:
        """Main-thread loop until rank 0 finishes: metrics, progress, errors, stall watchdog."""
        stall = self.cfg.pipeline.stall_timeout
        log_every = self.cfg.run.log_every
        last_metrics: dict[str, float] = {}
        step, pending = 0, False
        marker, marker_t = None, time.monotonic()
        while True:
            if (err := self.group.first_error()) is not None:
                raise err.to_exception()
            try:
                rec = self.records.get(timeout=0.25)
            except TimeoutError:
                rec = None
            except QueueStopped:
                continue  # the error that set stop is raised at the top of the loop
            if rec is END:
                break
            if isinstance(rec, _EvalRecord):
                self.sink.log(rec.step, {"eval/tau": rec.tau, "eval/seconds": rec.seconds})
                last_metrics["eval/tau"] = rec.tau
                progress.note(f"[eval] step {rec.step}: tau {rec.tau:.3f} ({rec.seconds:.1f}s)")
                continue
            if rec is not None:
                interval.add(rec.outcome, rec.grad_norm)
                step, pending = rec.step, True
                progress.update(1)
                if step % log_every == 0:
                    last_metrics.update(self._log(interval, step, rec.lr, progress))
                    pending = False
            now = time.monotonic()
            mark = (
                self.jobs.stats().put_total,
                self.hs_queue.stats().put_total,
                self.hs_queue.stats().got_total,
                step,
            )
            if mark != marker:
                marker, marker_t = mark, now
            elif now - marker_t > stall:
                self.group.fail(
                    "watchdog",
                    TimeoutError(
                        f"no pipeline progress for {stall:.0f}s (threads alive: "
                        f"{self.group.alive()}; job queue {len(self.jobs)}, hidden-state queue "
                        f"{len(self.hs_queue)})"
                    ),
                )
        if pending:
            last_metrics.update(self._log(interval, step, self.replicas[0].lr, progress))
        return step, last_metrics

    def _log(self, interval: IntervalMetrics, step: int, lr: float, progress: Progress) -> dict:
        metrics = interval.flush(self.timers, self.hs_queue, lr)
        metrics["train/epoch"] = self._epoch_progress()
        metrics.update(self.telemetry.sample())
        self.sink.log(step, metrics)
        fields = {
            "loss": metrics.get("train/loss", float("nan")),
            "tau": metrics.get("train/tau_est", float("nan")),
            "tok/s": round(metrics["train/tokens_per_s"]),
            "hsq": int(metrics["queue/depth"]),
        }
        if progress.interactive:
            progress.set_fields(**fields)
        else:
            progress.note(
                f"[train] step {step}/{self.total_steps} "
                + " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in fields.items()
                )
            )
        return metrics

    def _epoch_progress(self) -> float:
        trained = self.accounting.totals()["trained"]
        return trained / len(self.dataset)

    def _shutdown(self) -> None:
        """Stop producers still running (max_steps reached or failure) and join every thread."""
        self.stop.set()
        for q in (self.jobs, self.hs_queue, self.records):
            q.stop()
        self.group.join(timeout_s=30.0)

    def _train_state(self, step: int, complete: bool) -> dict[str, Any]:
        epochs = self.cfg.run.epochs
        current = next(
            (e for e in range(epochs) if not self.accounting.trained_bitmap(e).all()), epochs
        )
        return {
            "step": step,
            "total_steps": self.total_steps,
            "complete": complete,
            "epoch": current,
            "epochs": epochs,
            "seed": self.cfg.run.seed,
            "trained_sequences": self.accounting.totals()["trained"],
        }

    def _save(self, path: Path, state: dict[str, Any]) -> Path:
        """Weights, optimizer moments and the per-epoch trained-id bitmap (for exact resume)."""
        rep = self.replicas[0]
        trained = np.stack([self.accounting.trained_bitmap(e) for e in range(self.cfg.run.epochs)])
        return save_checkpoint(path, rep.model, state, optimizer=rep.optimizer, trained=trained)

    def _save_after_failure(self) -> None:
        """Keep the weights trained so far; a failure to save must not hide the original error."""
        try:
            self._save_final(self.replicas[0].step, complete=False, reason="interrupted or failed")
        except Exception as e:  # reported, then the original error propagates
            self.say(f"warning: could not save a checkpoint after the failure: {e}")

    def _save_final(self, step: int, complete: bool, reason: str) -> Path:
        rep = self.replicas[0]
        state = self._train_state(rep.step, complete)
        state["reason"] = reason
        path = self._save(self.run_dir / "checkpoint", state)
        self.say(f"checkpoint ({reason}, step {rep.step}): {path}")
        return path
