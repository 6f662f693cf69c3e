"""What the main thread makes of rank 0's step records: interval metrics, the metric sinks, GPU
telemetry and the progress line. Host syncs happen here, at log steps only."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import numpy as np

from dflash_train.metrics.logger import MetricsLogger, NullLogger
from dflash_train.metrics.telemetry import GpuTelemetry
from dflash_train.pipeline.build import Pipeline
from dflash_train.pipeline.distributed import NodeGroup
from dflash_train.progress import Progress
from dflash_train.train.interval import IntervalMetrics
from dflash_train.train.step_records import EvalRecord, StepRecord


class Diverged(ValueError):
    """The training loss or the weights are not finite: the run diverged (a learning rate too
    high for the model); nothing more is trained or saved (a user error: one line, exit 2)."""


class RunReporter:
    """Turns step and eval records into metric lines every `log_every` steps; owns the sinks,
    the telemetry and the progress line, and closes them all in `close()`."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        total_steps: int,
        log_every: int,
        num_rows: int,
        num_targets: int,
        progress: bool,
        say: Callable[[str], None],
        sink: MetricsLogger | None = None,
        telemetry: GpuTelemetry | None = None,
        nodes: NodeGroup | None = None,
        counters: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """`counters`: more metrics read at every log step (this node's, not summed)."""
        self.pipeline, self.total_steps, self.log_every = pipeline, total_steps, log_every
        self.num_rows, self.show_progress, self.say = num_rows, progress, say
        self.sink: MetricsLogger = sink or NullLogger()
        self.telemetry = telemetry
        self.nodes = nodes  # every node flushes at every log step; the sums need them all
        self.counters = counters
        weights = pipeline.settings.bucket_weights or {}
        self.interval = IntervalMetrics(weights, num_targets, len(pipeline.replicas))
        self.progress: Progress | None = None
        self.last_metrics: dict[str, float] = {}
        self.step = 0
        self._pending = False
        self._lr = 0.0

    def start(self) -> None:
        """Show the progress line (a bar on a terminal); the interval clock starts now."""
        # Off a terminal, one line per log step; no timed lines in between.
        self.progress = Progress(
            self.total_steps,
            "train",
            enabled=self.show_progress,
            unit="step",
            interval_s=float("inf"),
        )
        self.interval.t0 = time.monotonic()

    def add(self, rec: StepRecord | EvalRecord) -> None:
        assert self.progress is not None, "start() first"
        if isinstance(rec, EvalRecord):
            self.sink.log(rec.step, {"eval/tau": rec.tau, "eval/seconds": rec.seconds})
            self.last_metrics["eval/tau"] = rec.tau
            self.progress.note(f"[eval] step {rec.step}: tau {rec.tau:.3f} ({rec.seconds:.1f}s)")
            return
        self.interval.add(rec.outcome, rec.grad_norm, rec.ready)
        self.step, self._lr, self._pending = rec.step, rec.lr, True
        self.progress.update(1)
        if self.step % self.log_every == 0:
            self._log()

    def finish(self) -> dict[str, float]:
        """Log the steps since the last log step; the run's last metrics."""
        if self._pending:
            self._log()
        return self.last_metrics

    def _log(self) -> None:
        p = self.pipeline
        across = None if self.nodes is None else self.nodes.sum_metrics
        metrics = self.interval.flush(p.timers, p.hs_queue, self._lr, across)
        loss = metrics.get("train/loss")
        if loss is not None and not math.isfinite(loss):
            raise Diverged(
                f"the training loss is {loss} over the steps to {self.step}: the run diverged "
                "(is --lr too high?); stopped, and the newest checkpoint stands"
            )
        metrics["train/epoch"] = self._job_trained() / self.num_rows
        metrics.update(self._telemetry())
        if self.counters is not None:
            metrics.update(self.counters())
        self.sink.log(self.step, metrics)
        self.last_metrics.update(metrics)
        self._pending = False
        fields = {
            "loss": metrics.get("train/loss", float("nan")),
            "tau": metrics.get("train/tau_est", float("nan")),
            "tok/s": round(metrics["train/tokens_per_s"]),
            "hsq": int(metrics["queue/depth"]),
        }
        assert self.progress is not None
        if self.progress.interactive:
            self.progress.set_fields(**fields)
            return
        text = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
        )
        self.progress.note(f"[train] step {self.step}/{self.total_steps} {text}")

    def _job_trained(self) -> int:
        """Sequences the whole job has trained, across epochs and resumes. Rank 0's accounting
        also holds what a resumed run restored (the job's, counted once), every node's what it
        trained since: their sum is exact, whatever the shards' sizes (a collective: every
        node logs at the same steps)."""
        trained = self.pipeline.accounting.totals()["trained"]
        if self.nodes is None:
            return trained
        return round(float(self.nodes.sum_metrics(np.array([float(trained)]))[0]))

    def _telemetry(self) -> dict[str, float]:
        """GPU readings; telemetry is advisory, so its first failure turns it off, said once."""
        if self.telemetry is None:
            return {}
        try:
            return self.telemetry.sample()
        except Exception as e:  # reported once; training goes on without telemetry
            self.say(f"GPU telemetry failed ({type(e).__name__}: {e}); off for the rest of the run")
            telemetry, self.telemetry = self.telemetry, None
            with contextlib.suppress(Exception):  # it already failed and was reported
                telemetry.close()
            return {}

    def close(self) -> None:
        """Close the progress line, the sinks and the telemetry; a failure to close one is
        reported and does not keep the others open. Safe to call more than once."""
        for name, closer in (
            ("progress", self.progress),
            ("metrics", self.sink),
            ("telemetry", self.telemetry),
        ):
            if closer is None:
                continue
            try:
                closer.close()
            except Exception as e:  # reported; the run's own outcome stands
                self.say(f"warning: could not close the {name}: {type(e).__name__}: {e}")
        self.progress, self.sink, self.telemetry = None, NullLogger(), None
