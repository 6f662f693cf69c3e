"""The training run: build everything from a `TrainConfig`, run the pipeline, save, close.

    build() -> run() -> [watch the pipeline -> finish] -> close()   (close on every path)

The pipeline (`dflash_train.pipeline`) moves batches and gradients; this module owns what makes
it training: the drafter replicas and targets it runs, the schedule length, the run directory,
metrics, in-loop evaluation, checkpoints and resume. The main thread only watches: it turns rank
0's step records into metric lines (the only host syncs), re-raises the first worker error and
turns SIGINT / SIGTERM into a graceful stop. Every path that ends a run (success, a worker error,
an accounting problem, a signal, Ctrl-C) saves the weights trained so far and closes the metric
sinks, the telemetry, the checkpoint writer and every pipeline thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import ObjectiveOptions, TrainConfig, on_policy_only_options
from dflash_train.data.chat import load_chat_template
from dflash_train.data.dataset import PreparedDataset
from dflash_train.devices import (
    configure_cpu_threads,
    default_cpu_threads,
    default_devices,
    marks_here,
)
from dflash_train.metrics.logger import MetricsLogger
from dflash_train.metrics.telemetry import GpuTelemetry
from dflash_train.model import flex
from dflash_train.model.draft import served_repeats
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.distributed import NodeGroup, check_one_process_per_gpu_node
from dflash_train.pipeline.mixing import mix_notes
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.sync import StepOutcome
from dflash_train.pipeline.workers import EXIT_HUNG
from dflash_train.store.manifest import Manifest
from dflash_train.train.checkpoint import CheckpointWriter, ResumePoint, restore_rng, set_aside
from dflash_train.train.features import FeatureStages, build_feature_stages
from dflash_train.train.in_loop_eval import InLoopEval
from dflash_train.train.models import (
    Targets,
    build_replicas,
    capture_target_graphs,
    compile_extractors,
    measure_batch_cost,
)
from dflash_train.train.optimizers import describe_optimizer
from dflash_train.train.reporting import RunReporter
from dflash_train.train.resume import Resume, fallback_note, node_count_note
from dflash_train.train.run_dir import (
    check_run_dir,
    lock_run_dir,
    prepare_run_dir,
    resume_run_dir,
)
from dflash_train.train.saving import RunSaver
from dflash_train.train.setup import TrainingData, unused_dflash2_options
from dflash_train.train.signals import StopSignals, job_signal
from dflash_train.train.step_records import EvalRecord, StepRecord, StepRecords
from dflash_train.train.warm_up import compile_replicas, warm_up

SinkFactory = Callable[[Path, dict[str, Any]], MetricsLogger]
STOP_GUARD_SLACK_S = 30.0
"""After a stop signal, beyond 3 x --stop-timeout (the drafters' stop, the join, the final
checkpoint), how long the rest of `run` (the last metric lines, accounting) may take."""


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path | None
    steps: int
    complete: bool
    accounting: str
    last_metrics: dict[str, float]
    wall_s: float
    per_epoch: list[dict[str, Any]] = field(default_factory=list)
    interrupted: str | None = None
    """The signal that stopped the run (SIGINT, SIGTERM), or None."""
    resumed_from: list[int] = field(default_factory=list)
    """The checkpoint steps this run (and earlier resumes of it) started from."""
    world_size: int = 1
    """Nodes (torchrun ranks) of the job; the accounting is summed over them."""
    weights_digest: str = ""
    """sha256 of the trained weights, the same on every replica of every node (checked)."""


class Trainer:
    """Owns one training run. `run()` returns a `TrainResult` or raises the first failure."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        sink_factory: SinkFactory | None = None,
        log: Callable[[str], None] | None = None,
        resume: Resume | None = None,
        nodes: NodeGroup | None = None,
    ) -> None:
        self.cfg, self.resume, self.nodes = cfg, resume, nodes
        self.is_main = nodes is None or nodes.is_main
        self.say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.sink_factory = sink_factory
        self.pipeline: Pipeline | None = None
        self.features: FeatureStages | None = None
        self.reporter: RunReporter | None = None
        self.saver: RunSaver | None = None
        self.targets: Targets | None = None  # the feature sources, and an engine to stop
        self.signals = StopSignals()
        self._stopping = False
        self._stop_deadline: float | None = None  # a stop signal's drafters must end by then
        self._threads_left = False  # a join left pipeline threads: not waited for again
        self._ended = threading.Event()  # run() has returned or raised (the stop guard's)
        self._run_lock: int | None = None  # the run directory's flock (`lock_run_dir`)
        self._stance_set = False  # torch.compiler's stance, process-wide, restored by close()
        self.cost_fit: dict[str, float] | None = None  # what --batch-cost auto measured
        self.batch_cost_from: str | None = None  # flops or auto: how the share was decided

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        """Everything that can fail on bad input, then the run directory and the sinks."""
        point = self.resume.point if self.resume else None
        if self.is_main:  # before anything reads or replaces what it holds
            out = self.resume.run_dir if self.resume else Path(self.cfg.run.out)
            self._run_lock = lock_run_dir(out)
        self._load_data(point)
        self._resolve_devices()
        self.total_steps = self._total_steps()
        self._build_models(point)
        self._plan_and_warm_up()
        self.evaluator = self._build_evaluator()
        self._build_pipeline(point)
        self.records = StepRecords(self.cfg.run.log_every, self.pipeline.stop_event)
        self._check_mix()
        self._open_run_dir()

    def _load_data(self, point: ResumePoint | None) -> None:
        """The data set-up (this node's shard of the plan, less what a resumed run trained)."""
        cfg = self.cfg
        if not cfg.model.target:
            raise ValueError("--target is required (a Hugging Face model directory)")
        if self.resume is None and self.is_main:
            check_run_dir(cfg.run.out, cfg.run.overwrite)  # refused before any model loads
        shard = (0, 1) if self.nodes is None else (self.nodes.rank, self.nodes.world_size)
        done = None if point is None else point.done
        self.data = TrainingData.load(cfg, done=done, shard=shard)
        if point is not None and (changes := point.drafter_changes(self.data.draft_config)):
            raise ValueError(  # before any model loads
                f"{point.path} trained another drafter than this run builds "
                f"({'; '.join(changes)}): resume with the tokenizer, --init-from and version the "
                "run started with, or start a new run"
            )
        if cfg.pipeline.batching == "work" and cfg.pipeline.batch_cost == "flops":
            self._record_flops_share()
        unused = unused_dflash2_options(cfg)
        if unused:
            self.say(f"note: {', '.join(unused)} have no effect with --arch dflash")
        ids = self.data.draft_config.target_layer_ids
        if self.is_main and (repeats := served_repeats(ids)):
            self.say(
                f"note: the target layers {ids} repeat {repeats} (more features than the "
                "target's layers spread over): vLLM and SGLang gather each layer once and "
                "cannot serve this drafter (the reference client can); a lower "
                "--num-target-features avoids it"
            )
        if cfg.objective.loss != "lk_lambda" and cfg.objective.lk_eta != ObjectiveOptions().lk_eta:
            self.say(f"note: --lk-eta has no effect with --loss {cfg.objective.loss}")
        unused = on_policy_only_options(cfg.objective)
        if unused:
            self.say(f"note: {', '.join(unused)} have no effect with --anchors random")

    def _record_flops_share(self) -> None:
        """--batch-cost flops: the share the plan was made with, in the config (so the
        checkpoints and a resumed run carry it, whatever a later version counts)."""
        share = self.data.plans.batching.token_share
        pipeline = dataclasses.replace(self.cfg.pipeline, batch_cost=f"{share:g}")
        self.cfg = dataclasses.replace(self.cfg, pipeline=pipeline)
        self.batch_cost_from = "flops"
        if self.is_main:  # every rank plans alike: said once
            self.say(
                f"batch cost (--batch-cost flops): {share:.0%} of a full batch's FLOPs grow with "
                f"its tokens, the rest with its block positions; work batches are planned with "
                f"token share {share:g}"
            )

    def _resolve_devices(self) -> None:
        p = self.cfg.pipeline
        self.target_devices, self.drafter_devices = default_devices(
            p.target_devices, p.drafter_devices, p.share_device
        )
        check_one_process_per_gpu_node([*self.target_devices, *self.drafter_devices])
        if self.nodes is not None:
            self._check_drafters_per_node()
        if p.cuda_graphs and any(d.type != "cuda" for d in self.target_devices):
            raise ValueError(
                "--cuda-graphs captures the target forward on CUDA devices; the target devices "
                f"are {', '.join(map(str, self.target_devices))}"
            )
        ncpu = sum(d.type == "cpu" for d in (*self.target_devices, *self.drafter_devices))
        self.cpu_threads = p.cpu_threads or default_cpu_threads(ncpu)

    def _check_drafters_per_node(self) -> None:
        """Every node steps once per step with the same number of batches: other drafter counts
        plan other schedules, and the node that ran out first left the others in the step's
        collective until its timeout. A collective: every node compares, every node refuses."""
        assert self.nodes is not None
        counts = [int(n) for n in self.nodes.gather_text(str(len(self.drafter_devices)))]
        if len(set(counts)) > 1:
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise ValueError(
                f"the nodes have different numbers of drafters ({per_rank}): each node steps "
                "with its drafters' batches, so every node needs as many; give "
                "--drafter-devices explicitly (the default is every GPU but cuda:0)"
            )

    def _build_models(self, point: ResumePoint | None) -> None:
        """The feature stages (their store checks come before any model loads), the drafter
        replicas and, with --compile, their compiled forms."""
        cfg, p = self.cfg, self.cfg.pipeline
        self.timers = StageTimers()  # every stage's seconds, the replicas' device stages too
        self.features = build_feature_stages(
            cfg, self.data, self.target_devices, self.drafter_devices, self.say
        )
        self.targets = self.features.targets  # closed (an engine stopped) if what follows fails
        if point is not None:  # the hybrid reads the rows the uninterrupted run read
            self.features.resume_cache(point.state.get("feature_cache_start"))
        self.extractors = self.features.extractors
        node = (0, 1) if self.nodes is None else (self.nodes.rank, self.nodes.world_size)
        self.replicas = build_replicas(
            cfg, self.data, self.drafter_devices, self.total_steps, self.timers, point, node
        )
        if p.compile:
            compile_replicas(self.replicas)
            if self.targets.in_process:  # an engine compiles its own
                compile_extractors(self.extractors, self.data, self.say)

    def _plan_and_warm_up(self) -> None:
        """--batch-cost auto's measurement (it re-plans), then the warm-up on the final plan."""
        if self.cfg.pipeline.batching == "work" and self.cfg.pipeline.batch_cost == "auto":
            self._measure_batch_cost()
        cfg, p, d = self.cfg, self.cfg.pipeline, self.data
        # On the plan as the cost probe left it: the shapes the workers will meet.
        warm_up(self.replicas, d.plans, d.builder, cfg.run.epochs, self.say, p.compile)
        if p.cuda_graphs:
            capture_target_graphs(self.extractors, self.data, cfg.run.epochs, self.say)
        if p.compile or any(r.attention == "flex" for r in self.replicas):
            # Every planned shape was traced above, serially: a shape missed falls back to
            # eager (flex counts it) instead of tracing in a worker thread (tracing from two
            # threads races, and stalls the others).
            torch.compiler.set_stance("eager_on_recompile")
            self._stance_set = True
        self._flex_eager_start = flex.eager_calls()  # the run's count starts after warm-up

    def _build_pipeline(self, point: ResumePoint | None) -> None:
        d, f = self.data, self.features
        self.pipeline = Pipeline(
            self._pipeline_settings(),
            TargetFeed(d.plans, d.builder, f.sources, f.readers),
            self.replicas,
            listener=self,
            log=self.say,
            timers=self.timers,
            on_unresponsive=self._last_resort,
            nodes=self.nodes,
            describe_stall=None if self.targets is None else self.targets.describe_failure,
        )
        if point is not None and self.is_main:  # counted once, however many nodes
            self.pipeline.accounting.restore(point.done)
            restore_rng(point)

    def _measure_batch_cost(self) -> None:
        """--batch-cost auto: time the first drafter on probe batches, plan with the measured
        token share (rank 0's, on every node) and record it in the config, so the checkpoints
        and a resumed run carry the share the batches were planned with."""
        t0 = time.monotonic()
        fit = measure_batch_cost(self.replicas[0], self.data) if self.is_main else None
        share = fit.token_share if fit is not None else 0.0
        if self.nodes is not None:
            share = self.nodes.share_from_main(share)
        pipeline = dataclasses.replace(self.cfg.pipeline, batch_cost=f"{share:g}")
        self.cfg = dataclasses.replace(self.cfg, pipeline=pipeline)
        self.batch_cost_from = "auto"
        if fit is not None:
            self.cost_fit = {
                "per_token_s": fit.per_token_s,
                "per_block_s": fit.per_block_s,
                "overhead_s": fit.overhead_s,
                "token_share": share,
            }
            self.say(
                f"batch cost (--batch-cost auto, measured in {time.monotonic() - t0:.1f}s on "
                f"{self.replicas[0].device}): {fit.describe()}; work batches are planned with "
                f"token share {share:g} (--batch-cost {share:g} plans the same batches again)"
            )
        if share == 0.0:
            return  # the plan already made is the one
        self.data = self.data.with_token_share(share)
        self.total_steps = self._total_steps()
        for rep in self.replicas:
            rep.total_steps = self.total_steps

    def _check_mix(self) -> None:
        """Notes on the length mix and the queue's depth (`mixing.mix_notes`)."""
        p = self.cfg.pipeline
        if p.mix not in ("plan", "stratified"):
            return
        nodes = 1 if self.nodes is None else self.nodes.world_size
        epoch = self.data.plans.batches_per_epoch() // nodes  # this node's shard
        notes = mix_notes(
            self.data.weights,
            self._draws_per_step(),
            p.hs_queue_depth,
            epoch,
            arrival=p.mix != "plan",
        )
        for note in notes:
            self.say(note)

    def _draws_per_step(self) -> int:
        """Batches one optimizer step trains, over every node."""
        nodes = 1 if self.nodes is None else self.nodes.world_size
        return nodes * len(self.drafter_devices) * self.cfg.optim.grad_accum

    def _data_line(self) -> str:
        """The data and the schedule: batches per epoch, how many batches one optimizer step
        takes (drafters x accumulation) and the steps that makes (or --max-steps)."""
        d, r = self.data, self.cfg.run
        drafters = len(self.drafter_devices) * (1 if self.nodes is None else self.nodes.world_size)
        accum = self.cfg.optim.grad_accum
        per_step = f"{drafters * accum} ({drafters} drafter{'s' * (drafters > 1)}" + (
            f" x {accum} accumulated)" if accum > 1 else ")"
        )
        capped = f" (--max-steps {r.max_steps})" if r.max_steps == self.total_steps else ""
        return (
            f"data: {len(d.dataset)} sequences, buckets {d.bucket_lengths}, "
            f"{d.plans.batches_per_epoch()} batches/epoch x {r.epochs} epochs, {per_step} per "
            f"optimizer step -> {self.total_steps} optimizer steps{capped}"
        )

    def _total_steps(self) -> int:
        """The schedule's length: the steps the data needs (or --max-steps); a resumed run
        keeps its checkpoint's unless --max-steps extends it or the rest of its data needs
        more on this job's nodes (a resume on another node count deals it anew).

        The nodes step in lockstep, each through its own stream of batches (its share of
        every epoch), so the data needs as many steps as the LONGEST stream: counting the
        epoch's batches over all nodes instead left a node's last batches untrained."""
        r = self.cfg.run
        per_step = len(self.drafter_devices) * self.cfg.optim.grad_accum  # one node's batches
        needed = math.ceil(max(self.data.plans.stream_lengths()) / per_step)
        if self.resume is None:
            self._data_steps = needed
            return min(needed, r.max_steps) if r.max_steps else needed
        saved = int(self.resume.point.state["total_steps"])
        self._data_steps = self.resume.point.step + needed  # the plan's rest, from here
        if r.max_steps is not None and r.max_steps > saved:
            return min(self._data_steps, r.max_steps)  # extended on purpose
        if r.max_steps is not None or self._data_steps <= saved:
            return saved
        self.say(
            f"note: the rest of the data needs {needed} steps on this job's nodes; the schedule "
            f"grows from {saved} to {self._data_steps} steps so that every row is trained"
        )
        return self._data_steps

    def _build_evaluator(self) -> InLoopEval | None:
        m, r = self.cfg.model, self.cfg.run
        if not self.is_main:
            return None  # one evaluation per job, on rank 0
        if not r.eval_every:
            if r.eval_prompts:
                self.say("note: --eval-prompts has no effect without --eval-every")
            return None
        dev = self.drafter_devices[0]
        return InLoopEval(
            r,
            m.target,
            dev,
            self.replicas[0].compute_dtype,
            m.trust_remote_code,
            chat_thinking=self.data.draft_config.chat_thinking,  # the data's mode, not a default
            chat_template=data_chat_template(self.data.dataset, self.say),
        )

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
            stop_timeout_s=r.stop_timeout,
            seed=r.seed,
            block_size=self.data.draft_config.block_size,
            selector_stats=self.data.draft_config.is_dflash2,
        )

    def _open_run_dir(self) -> None:
        """Create (or, resuming, reuse) the run directory; then the sinks and the writer."""
        cfg = self.cfg
        self.resolved = {
            "bucket_lengths": self.data.bucket_lengths,
            "target_devices": [str(d) for d in self.target_devices],
            "drafter_devices": [str(d) for d in self.drafter_devices],
            "draft": self.data.draft_config.to_dict(),
            "mask_token_choice": self.data.mask_how,
        }
        if cfg.pipeline.features:  # what a resume from a moved store must find there too
            store = Manifest.read(Path(cfg.pipeline.features))
            self.resolved["features_dtype"] = store.binding.dtype
        if self.batch_cost_from is not None:
            self.resolved["batch_cost_from"] = self.batch_cost_from
        if self.cost_fit is not None:
            self.resolved["batch_cost_fit"] = self.cost_fit  # what --batch-cost auto measured
        written = {**cfg.to_dict(), "resolved": self.resolved}
        if self.nodes is not None:
            written["resolved"]["world_size"] = self.nodes.world_size
        if not self.is_main:
            self.run_dir = Path(cfg.run.out)  # rank 0 alone writes into it
        elif self.resume is None:
            self.run_dir = prepare_run_dir(cfg.run.out, cfg.run.overwrite, written)
            if self._run_lock is None:  # created just now
                self._run_lock = lock_run_dir(self.run_dir)
        else:
            self.run_dir = resume_run_dir(self.resume.run_dir, written)
            set_aside(self.run_dir, self.resume.point)  # checkpoints it could not read
        writer = None
        if self.is_main:
            writer = CheckpointWriter(self.run_dir, cfg.run.keep_last, self.timers)
        assert self.pipeline is not None
        self.saver = RunSaver(
            cfg, self.data, self.replicas, self.pipeline, self.timers, self.resolved,
            self.total_steps, self.say, writer, self.nodes, self.resume,
            cache_start=self.features.cache_start(),
        )  # fmt: skip
        self.reporter = self._build_reporter(written)

    def _build_reporter(self, written: dict[str, Any]) -> RunReporter:
        assert self.pipeline is not None
        gpus = {d.index for d in (*self.target_devices, *self.drafter_devices) if d.type == "cuda"}
        reporter = RunReporter(
            self.pipeline,
            total_steps=self.total_steps,
            log_every=self.cfg.run.log_every,
            num_rows=len(self.data.dataset),
            num_targets=self.features.workers,
            progress=self.cfg.metrics.progress and self.is_main,
            say=self.say,
            telemetry=GpuTelemetry(sorted(gpus)),
            nodes=self.nodes,
            counters=self._target_counters,
        )
        if self.sink_factory is not None and self.is_main:
            try:
                reporter.sink = self.sink_factory(self.run_dir, written)
            except BaseException:
                reporter.close()  # the telemetry opened above
                raise
        return reporter

    def _target_counters(self) -> dict[str, float]:
        """With CUDA graphs: batches this node's targets ran eagerly since the start, because
        they had more rows than captured (0 when every planned batch fits, as it should).
        With flex: this node's attention calls since the warm-up that ran flex's unfused
        kernel (0 when every batch's shape was warmed up, as it should). With a feature store,
        its reads (`FeatureStages.counters`)."""
        out = self.features.counters()
        if any(getattr(ex, "has_graphs", False) for ex in self.extractors):
            misses = sum(ex.graph_misses for ex in self.extractors)
            out["time/target_graph_misses"] = float(misses)
        if any(r.attention == "flex" for r in self.replicas):
            out["time/flex_eager_calls"] = float(flex.eager_calls() - self._flex_eager_start)
        return out

    def describe(self) -> str:
        p, r, d = self.cfg.pipeline, self.cfg.run, self.data
        nparams = sum(x.numel() for x in self.replicas[0].params)
        qbytes = p.hs_queue_bytes or "unbounded"
        dc = d.draft_config
        lines = [
            f"run dir: {self.run_dir}",
            self._data_line(),
            f"drafter: {dc.arch}, {dc.num_hidden_layers} layers, {nparams / 1e6:.2f}M trainable "
            "params, "
            f"block {dc.block_size}, target layers {dc.target_layer_ids}, mask id "
            f"{dc.mask_token_id} ({d.mask_how}), attention {self.replicas[0].attention}",
            f"pipeline: {p.num_prefetchers} prefetchers -> job queue (depth "
            f"{p.job_queue_depth}) -> {self.features.description} -> hidden-state queue (depth "
            f"{p.hs_queue_depth}, min_ready {p.hs_min_ready}, bytes {qbytes}, mix {p.mix}; "
            f"features stay on their producer's device) -> {len(self.replicas)} drafter workers "
            f"{[str(x) for x in self.drafter_devices]}, lockstep",
        ]
        positions = self.replicas[0].positions
        weights = (
            f"D-PACE position weights (alpha {positions.alpha:g}), loss / valid anchors"
            if positions.dynamic
            else "decayed position weights, loss / their sum"
        )
        loss = self.replicas[0].loss
        if loss.needs_teacher:
            eta = f" (eta {loss.lk_eta:g})" if loss.kind == "lk_lambda" else ""
            loss_line = f"loss {loss.kind}{eta} on the target's distribution"
        else:
            loss_line = "loss ce on the data's tokens"
        streams = self.replicas[0].streams
        if streams is not None:
            rejected = (
                f"rejected drafts k3 x {streams.rejected_weight:g} x {streams.opd_gamma:g}^(k-1)"
                if streams.rejected_weight > 0
                else "no rejected-draft stream"
            )
            loss_line += f"; on-policy anchors (the drafter's rounds, every step), {rejected}"
        lines.append(
            f"objective: {loss_line}; {weights}; {describe_optimizer(self.replicas[0].optimizer)}"
        )
        if self.targets is not None and not self.targets.in_process:
            lines.append(f"target: {self.targets.describe()}")
        if r.recipe:
            lines.append(
                f"recipe {r.recipe} (`dflash-train recipes {r.recipe}`: its values and their "
                "sources; flags and --config override them)"
            )
        if self.cfg.model.init_from and self.resume is None:
            lines.append(f"drafter weights initialised from {self.cfg.model.init_from}")
        if self.resume is not None:
            point = self.resume.point
            left = int((~point.done).sum())
            lines += fallback_note(point)
            lines.append(f"resuming from {point.path} (step {point.step}; {left} sequences left)")
            now = 1 if self.nodes is None else self.nodes.world_size
            lines += node_count_note(point, now)
        return "\n".join(lines)

    # ------------------------------------------------------------------ run
    def run(self) -> TrainResult:
        """Start, watch until the drafters finish, account and save; close on every path."""
        t_start = time.monotonic()
        self.say(self.describe())
        assert self.pipeline is not None, "build() first"
        try:
            with self.signals:
                configure_cpu_threads(self.cpu_threads)
                self.pipeline.start()
                _, last = self._watch()
                # The steps applied, as the checkpoint records them: a stop can drop the last
                # step's record (its queue full while the main thread was behind).
                step = self.replicas[0].step
                return self._finish(step, last, time.monotonic() - t_start)
        except BaseException as failure:
            # After a stop signal, what is left of its --stop-timeout (none, when the drafters
            # outlasted it): one timeout bounds the whole stop.
            deadline = self._stop_deadline
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._stop_pipeline(strict=False, timeout_s=left)
            if self.saver is not None:
                self.saver.after_failure(failure)
            raise
        finally:
            # The stop guard watches up to here: what close() waits for is bounded on its own
            # (an engine's stop, a write's deadline), and ending it with 124 would cut them short.
            self._ended.set()
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
        raises the first worker error; a stop signal stops the pipeline in order."""
        assert self.pipeline is not None
        while True:
            self.pipeline.check()
            if self.signals.received is not None and not self._stopping:
                self._stopping = True
                self._begin_stop()
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                stuck = [t for t in self.pipeline.alive() if t.startswith("drafter-")]
                what = (
                    f"the drafters ({', '.join(stuck)} still running) did not stop"
                    if self.nodes is None
                    else "the nodes did not end at an agreed step"
                )
                raise RuntimeError(
                    f"{what} within --stop-timeout {self.cfg.run.stop_timeout:g}s of "
                    f"{self.signals.name}; nothing new saved"
                )
            rec = self.records.get(timeout=0.25)
            if rec is not None:
                return rec
            if self.pipeline.drafters_done():
                self.pipeline.check()  # a drafter that failed has ended too: its error first
                # Every put happened before its thread ended: one more look drains the queue.
                return self.records.get(timeout=0.0)

    def _begin_stop(self) -> None:
        """A stop signal. On one node the drafters abandon the step in flight. Across nodes
        one node cannot: the others would wait in that step's collective. There the step's
        reduction carries the request, so every node applies it and ends after the same step
        (or the run fails after --stop-timeout)."""
        assert self.pipeline is not None
        name = self.signals.name
        self._stop_deadline = time.monotonic() + self.cfg.run.stop_timeout
        self._guard_stop()
        if self.nodes is None:
            self.say(
                f"{name}: stopping (finishing the step in flight, then saving a checkpoint; a "
                "second signal exits at once)"
            )
            self.pipeline.stop()  # drafters stop at their next wait, producers at theirs
            return
        self.say(
            f"{name}: stopping after the step in flight on every node (the nodes agree on the "
            "step), then saving a checkpoint; a second signal exits at once"
        )
        self.pipeline.request_stop()

    def on_step(self, outcome: StepOutcome, grad_norm: torch.Tensor | None) -> None:
        """Rank 0's drafter thread, after each applied step: records, evaluation, checkpoints
        (the other replicas wait at the next rendezvous meanwhile)."""
        rep = self.replicas[0]
        # The main thread reads the step's tensors later, on its own stream: it waits for this.
        ready = marks_here([rep.device])
        self.records.put(StepRecord(outcome, grad_norm, rep.step, rep.lr, ready))
        last = outcome.all_ended or rep.step >= self.total_steps
        if self.evaluator is not None and (self.evaluator.due(rep.step) or last):
            try:
                tau, seconds = self.evaluator(rep)
            except Exception as e:  # re-raised with the stage named; the worker is drafter-0
                raise RuntimeError(f"in-loop evaluation failed at step {rep.step}: {e}") from e
            self.records.put(EvalRecord(rep.step, tau, seconds))
        every = self.cfg.run.save_every
        if every and rep.step % every == 0 and not last:
            self.saver.periodic()

    # ------------------------------------------------------------------ finish, save, close
    def _finish(self, step: int, last: dict[str, float], wall_s: float) -> TrainResult:
        """The drafters are done: stop what still runs, account, save the final checkpoint."""
        assert self.pipeline is not None
        # A drafter that failed also ends this loop: raised here, before the collectives below,
        # which the other nodes (waiting in the step's) would never join.
        self.pipeline.check()
        interrupted = job_signal(self.signals, self.nodes)
        self._stop_pipeline(strict=interrupted is None)
        self.pipeline.check()  # an error raised while the pipeline wound down
        for rep in self.replicas:
            rep.flush_timers()
        acc = self.saver.job_accounting()
        diverged = self.saver.replica_divergence()
        complete = acc.totals()["trained"] == len(self.data.dataset) * self.cfg.run.epochs
        line = acc.summary_line(complete)
        self.say(line)
        if diverged is not None:  # saved first (marked), so the weights trained are not lost
            self.saver.final(complete=False, reason="replicas diverged", agreed=False)
            raise RuntimeError(diverged)
        if complete and acc.problems(complete=True):
            self.saver.final(complete=False, reason="accounting problem")
            raise RuntimeError(line)
        max_steps = self.cfg.run.max_steps
        asked = max_steps is not None and self.total_steps < self._data_steps
        if not complete and interrupted is None and not asked:
            # Neither --max-steps nor a stop ended the run early, and rows went untrained:
            # never an exit status 0 as if it had finished.
            self.saver.final(complete=False, reason="rows left untrained")
            raise RuntimeError(
                f"{line}; the schedule of {self.total_steps} steps ended with rows untrained "
                "(saved as an incomplete checkpoint; --resume continues it)"
            )
        reason = "finished" if interrupted is None else f"interrupted by {interrupted}"
        ckpt = self.saver.final(complete, reason=reason)
        return TrainResult(
            self.run_dir,
            ckpt,
            step,
            complete,
            line,
            last,
            wall_s,
            acc.per_epoch(),
            interrupted,
            self.saver.resumed_from(),
            1 if self.nodes is None else self.nodes.world_size,
            self.saver.weights_digest,
        )

    def _stop_pipeline(self, strict: bool, timeout_s: float | None = None) -> None:
        """Stop the producers still running (max_steps reached, a signal, a failure) and join
        every thread within `timeout_s` (--stop-timeout; none when an earlier join left
        threads: they had their time); a thread left is an error when `strict`."""
        assert self.pipeline is not None
        if timeout_s is None:
            timeout_s = 0.0 if self._threads_left else self.cfg.run.stop_timeout
        left = self.pipeline.shutdown(timeout_s=timeout_s)
        self._threads_left = bool(left)
        if left and strict:
            raise RuntimeError(f"worker threads did not exit: {left}")
        if left:
            self.say(f"warning: worker threads did not exit: {left}")

    def _last_resort(self, why: str | None = None) -> None:
        """The watchdog's thread, when the main thread did not react to a stall within
        --stop-timeout (it is the stuck one, e.g. in a metric backend), or the stop guard's:
        save what can be saved, say so, and end the process, since nothing can unstick that
        thread. It ends whatever fails on the way (stderr closed, a save that raises)."""
        assert self.pipeline is not None
        why = why or f"the main thread did not react within {self.cfg.run.stop_timeout:.0f}s"
        try:
            with contextlib.suppress(Exception):
                self.say(f"watchdog: {why}; saving what can be saved and exiting")
            self.pipeline.join(timeout_s=self.cfg.run.stop_timeout)
            if self.saver is not None:
                self.saver.after_failure()
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(EXIT_HUNG)

    def _guard_stop(self) -> None:
        """After a stop signal the run must end: the drafters' stop, the join of the other
        threads and the final checkpoint are each bounded by --stop-timeout, but a main thread
        stuck elsewhere (a metric backend logging the last lines, the watchdog being stopped
        with the pipeline) would hang it, unsaved, until the scheduler's SIGKILL. Past those
        bounds and STOP_GUARD_SLACK_S, the watchdog's last resort: save what can be saved,
        exit 124. It watches until `run` ends, not `close` (bounded on its own)."""
        budget = 3 * self.cfg.run.stop_timeout + STOP_GUARD_SLACK_S
        name = self.signals.name

        def guard() -> None:
            if not self._ended.wait(budget):
                self._last_resort(f"the run did not end within {budget:.0f}s of {name}")

        threading.Thread(target=guard, name="stop-guard", daemon=True).start()

    def close(self) -> None:
        """Release everything the run opened: every pipeline thread, the checkpoint writer, the
        progress line, the metric sinks and the telemetry. Safe on every path, more than once.
        Never raises: a part that cannot close is said in one line and the others still close
        (the run's own result or error is what the caller must see)."""
        run_dir = getattr(self, "run_dir", None)
        engine_log = run_dir / "engine.log" if run_dir and self.is_main else None
        if self.pipeline is not None:
            self._close_part("the pipeline", lambda: self._stop_pipeline(strict=False))
        if self.targets is not None:  # after the pipeline: no worker waits on the engine now
            self._close_part("the target", lambda: self.targets.close(engine_log))
        for name, part in (
            ("the checkpoint writer", self.saver),
            ("the metrics", self.reporter),
            ("the feature store", self.features),
        ):
            if part is not None:
                self._close_part(name, part.close)
        if self._stance_set:
            torch.compiler.set_stance("default")
            self._stance_set = False
        if self._run_lock is not None:
            os.close(self._run_lock)
            self._run_lock = None

    def _close_part(self, name: str, close: Callable[[], None]) -> None:
        """`close()`, its failure said in one line (`close` never raises)."""
        try:
            close()
        except Exception as e:
            self.say(f"warning: could not close {name}: {type(e).__name__}: {e}")


def data_chat_template(dataset: PreparedDataset, say: Callable[[str], None]) -> str | None:
    """The text of the template `prepare --chat-template` rendered `dataset` with, for the
    in-loop eval's prompts; None for the tokenizer's own, or (said) a file gone since."""
    named = dataset.chat_template_file()
    if named is None:
        return None
    try:
        return load_chat_template(named)
    except (OSError, ValueError) as e:
        say(
            "warning: eval/tau encodes its prompts with the target tokenizer's template: the "
            f"data's --chat-template {named} cannot be read ({e})"
        )
        return None
