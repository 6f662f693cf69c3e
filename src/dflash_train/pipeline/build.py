"""One running pipeline from its parts: queues, threads, rendezvous, stop event, accounting,
watchdog. The trainer, the benchmarks and the tuner all build theirs here: `Pipeline(settings,
feed, replicas, listener=..., log=..., timers=...)`.

    prefetchers --(job queue, FIFO)--> target workers --(hidden-state queue, mixed)--> drafters

Threads: `num_prefetchers` prefetchers, one target (or reader) worker per feature source (or
reader), one drafter per replica, and the watchdog. A clean end is counted, never guessed: every
producer signals done exactly once (also when it fails), the queues drain, and the drafters'
lockstep ends after the step in which every replica has seen the end of the stream. `check()`
re-raises the first worker error on the caller's thread; `stop()` asks every stage to end,
`join()` waits for the threads, and `shutdown()` does both; all are safe to call on every path,
more than once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash_train.objective import SELECTOR_STAT_ROWS
from dflash_train.pipeline.distributed import NodeGroup
from dflash_train.pipeline.drafter_worker import DrafterTask, run_drafter
from dflash_train.pipeline.monitor import Accounting, StageTimers, Watchdog
from dflash_train.pipeline.prefetch import PrefetchTask, run_prefetcher
from dflash_train.pipeline.queue import BufferedHSQueue, MixMode, QueueStats
from dflash_train.pipeline.stages import (
    BatchPlan,
    Channels,
    FeatureReader,
    FeatureSource,
    JobBuilder,
    Replica,
    StepListener,
    update_share,
)
from dflash_train.pipeline.sync import StepRendezvous, UpdateExchange
from dflash_train.pipeline.target_worker import run_reader_worker, run_target_worker
from dflash_train.pipeline.workers import WorkerGroup


@dataclass(frozen=True)
class PipelineSettings:
    """The pipeline's own knobs (the trainer derives them from its `PipelineOptions`)."""

    total_steps: int
    """Optimizer steps after which the drafters stop (the data may end earlier)."""
    grad_accum: int = 1
    num_prefetchers: int = 5
    job_queue_depth: int = 32
    hs_queue_depth: int = 90
    hs_min_ready: int = 30
    hs_queue_bytes: int | None = None
    mix: MixMode = "plan"
    """How drafters take batches: "plan" (the plan's order, restored in the queues, so every
    step's batches follow from the plan alone) or an arrival-order pull (stratified, random,
    fifo; see `pipeline.queue`)."""
    bucket_weights: dict[int, float] | None = None
    """The dataset's share of batches per bucket (stratified pull and its admission cap)."""
    stall_timeout_s: float = 900.0
    stop_timeout_s: float = 60.0
    """After a stall, how long the caller has to react before `on_unresponsive` runs."""
    seed: int = 0
    block_size: int = 16
    """Block offsets of the loss statistics (their size when summed across nodes)."""
    selector_stats: bool = False
    """Whether the loss statistics carry DFlash 2's selector rows (`LossOutput.selector`)."""


@dataclass
class TargetFeed:
    """The producer side of a training run: prefetchers over `plans` -> the job queue -> one
    target worker per feature source and one reader worker per feature reader (readers take
    the target workers' place when the features come from a store)."""

    plans: BatchPlan
    builder: JobBuilder
    sources: Sequence[FeatureSource]
    readers: Sequence[FeatureReader] = ()


@dataclass
class DirectFeed:
    """Producers that put `HSBatch`es on the hidden-state queue themselves, one thread each
    (benchmarks that script the arrival order). The job queue stays empty and closed."""

    producers: Sequence[Callable[[Channels], None]]
    num_rows: int
    epochs: int


@dataclass
class PipelineStats:
    """A snapshot for metrics and results."""

    jobs: QueueStats
    hidden_states: QueueStats
    accounting: dict[str, int]
    steps: int


class Pipeline:
    """A built pipeline: `start()`, then poll `check()` / `drafters_done()` (or `wait()`), then
    `shutdown()`.

    `listener` runs on rank 0 after every applied step; `log` receives the watchdog's report;
    `timers` collects every stage's seconds (pass the one the replicas report their device
    stages into, so all stages land in one place); `on_unresponsive` is the watchdog's last
    resort when the caller's own thread is the one stuck (see `Watchdog`); `nodes`, in a
    multi-node job, makes every step's reduction span the nodes (see `pipeline.distributed`);
    `describe_stall` adds what the pipeline cannot see to the watchdog's hang report (an
    out-of-process target's state and last log lines).
    """

    def __init__(
        self,
        settings: PipelineSettings,
        feed: TargetFeed | DirectFeed,
        replicas: Sequence[Replica],
        listener: StepListener | None = None,
        log: Callable[[str], None] | None = None,
        timers: StageTimers | None = None,
        on_unresponsive: Callable[[], None] | None = None,
        nodes: NodeGroup | None = None,
        describe_stall: Callable[[], str] | None = None,
    ) -> None:
        self.settings, self.feed, self.replicas = settings, feed, list(replicas)
        self._describe_stall = describe_stall
        self.nodes = nodes
        self.listener = listener
        self._timers = timers or StageTimers()
        self.stop_event = threading.Event()
        self.stop_request = threading.Event()  # see request_stop()
        self.group = WorkerGroup(self.stop_event)
        self.channels = self._channels()
        self.watchdog = Watchdog(
            settings.stall_timeout_s,
            self._progress_marker,
            self._describe_state,
            lambda message: self.group.fail("watchdog", TimeoutError(message)),
            log,
            on_unresponsive=on_unresponsive,
            grace_s=settings.stop_timeout_s,
        )
        self._drafters: list[threading.Thread] = []
        self._started = self._stopped = False

    def _channels(self) -> Channels:
        s, feed, stop = self.settings, self.feed, self.stop_event
        direct = isinstance(feed, DirectFeed)
        producers = len(feed.producers) if direct else s.num_prefetchers
        workers = 1 if direct else len(feed.sources) + len(feed.readers)
        # With the plan order the job queue keeps it too: target workers take jobs in plan
        # order, so the batch the drafters wait for is never queued behind later ones.
        jobs = BufferedHSQueue(
            s.job_queue_depth,
            1,
            1 if direct else s.num_prefetchers,
            mix="plan" if s.mix == "plan" else "fifo",
            stop_event=stop,
            name="job queue",
            reserve=workers,
        )
        if direct:
            jobs.producer_done()  # nothing is ever put: an empty, closed queue
        hs_queue = BufferedHSQueue(
            s.hs_queue_depth,
            s.hs_min_ready,
            producers if direct else workers,
            mix=s.mix,
            bucket_weights=s.bucket_weights,
            max_bytes=s.hs_queue_bytes,
            stop_event=stop,
            seed=s.seed,
            name="hidden-state queue",
            reserve=len(self.replicas) * s.grad_accum,  # one step's tickets on this node
        )
        stat_rows = 3 + SELECTOR_STAT_ROWS * s.selector_stats  # per-offset rows of LossOutput
        rendezvous = StepRendezvous(
            [r.flat_grad for r in self.replicas],
            stop,
            s.stall_timeout_s,
            nodes=self.nodes,
            loss_stats_size=1 + stat_rows * s.block_size,
            loss_stat_rows=stat_rows,
            stop_request=self.stop_request,
        )
        rows, epochs = (
            (feed.num_rows, feed.epochs) if direct else (feed.plans.num_rows, feed.plans.epochs)
        )
        shares = [update_share(r) for r in self.replicas]
        updates = None
        if any(x is not None for x in shares):
            assert all(x is not None for x in shares), "every replica splits, or none"
            updates = UpdateExchange(
                shares, stop, s.stall_timeout_s, self.nodes, failed=self._failed
            )
        acc = Accounting(rows, epochs)
        return Channels(stop, jobs, hs_queue, rendezvous, acc, self._timers, updates)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Drafters first (they wait on the queue), then the producers, then the watchdog."""
        assert not self._started, "a pipeline starts once"
        self._started = True
        s, ch, g = self.settings, self.channels, self.group
        for rank, replica in enumerate(self.replicas):
            listener = self.listener if rank == 0 else None
            task = DrafterTask(
                rank, replica, s.total_steps, s.grad_accum, listener, world=len(self.replicas)
            )
            self._drafters.append(g.spawn(f"drafter-{rank}", run_drafter, task, ch))
        if isinstance(self.feed, DirectFeed):
            for i, produce in enumerate(self.feed.producers):
                g.spawn(f"producer-{i}", produce, ch, on_exit=ch.hs_queue.producer_done)
        else:
            for i, source in enumerate(self.feed.sources):
                g.spawn(
                    f"target-{i}", run_target_worker, source, ch, on_exit=ch.hs_queue.producer_done
                )
            for i, reader in enumerate(self.feed.readers):
                g.spawn(
                    f"reader-{i}", run_reader_worker, reader, ch, on_exit=ch.hs_queue.producer_done
                )
            # Jobs copied to a CUDA device are pinned on the host, so the copies are async.
            devices = [src.device for src in [*self.feed.sources, *self.feed.readers]]
            pin = any(d.type == "cuda" for d in devices + [r.device for r in self.replicas])
            limit = self._stream_limit()
            for i in range(s.num_prefetchers):
                plans, builder = self.feed.plans, self.feed.builder
                task = PrefetchTask(i, s.num_prefetchers, plans, builder, pin, limit)
                g.spawn(f"prefetch-{i}", run_prefetcher, task, ch, on_exit=ch.jobs.producer_done)
        self.watchdog.start()

    def _stream_limit(self) -> int:
        """Stream positions the drafters can still train: every step takes one batch per
        replica and micro-batch (`DrafterTask.ticket`), until `total_steps` (a schedule cut by
        --max-steps ends before the data: the producers then stop where it does)."""
        s = self.settings
        steps_left = s.total_steps - min(r.step for r in self.replicas)
        return max(0, steps_left) * len(self.replicas) * s.grad_accum

    def _failed(self) -> bool:
        """Whether a worker (or the watchdog) has recorded an error."""
        return self.group.first_error() is not None

    def check(self) -> None:
        """Re-raise the first worker error (or the watchdog's) as a `PipelineError`."""
        if (err := self.group.first_error()) is not None:
            raise err.to_exception()

    def drafters_done(self) -> bool:
        """Whether every drafter thread has ended (training is over, or was stopped)."""
        return self._started and not any(t.is_alive() for t in self._drafters)

    def wait(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Block until the drafters are done or `timeout_s` passes (True: they finished);
        raises the first worker error as soon as it happens."""
        deadline = time.monotonic() + timeout_s
        while not self.drafters_done():
            self.check()
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        self.check()
        return True

    def stop(self) -> None:
        """Ask every stage still running to end: the stop event, then every queue's waiters."""
        if not self._stopped:
            self._stopped = True
            self.stop_event.set()
            for q in (self.channels.jobs, self.channels.hs_queue):
                q.stop()
            self.watchdog.stop()

    def request_stop(self) -> None:
        """Ask the drafters to end after the next step they reduce, on every node (the step's
        reduction carries the request), then the producers stop as at the end of the data.
        `stop()` instead abandons the step in flight, which one node alone cannot do without
        leaving the others waiting in that step's collective."""
        self.stop_request.set()

    def join(self, timeout_s: float = 30.0) -> list[str]:
        """Join every worker thread within one shared deadline; the names left alive."""
        return self.group.join(timeout_s=timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> list[str]:
        """`stop()` then `join()`; every exit path calls it."""
        self.stop()
        return self.join(timeout_s)

    # ------------------------------------------------------------------ state
    @property
    def accounting(self) -> Accounting:
        return self.channels.accounting

    @property
    def timers(self) -> StageTimers:
        return self.channels.timers

    @property
    def hs_queue(self) -> BufferedHSQueue:
        return self.channels.hs_queue

    def stats(self) -> PipelineStats:
        ch = self.channels
        return PipelineStats(
            ch.jobs.stats(), ch.hs_queue.stats(), ch.accounting.totals(), ch.rendezvous.steps
        )

    def alive(self) -> list[str]:
        return self.group.alive()

    def _progress_marker(self) -> tuple[int, int, int, int]:
        ch = self.channels
        return (
            ch.jobs.stats().put_total,
            ch.hs_queue.stats().put_total,
            ch.hs_queue.stats().got_total,
            ch.rendezvous.steps,
        )

    def _describe_state(self) -> str:
        ch = self.channels
        state = (
            f"threads alive: {self.group.alive()}; job queue {len(ch.jobs)}, hidden-state queue "
            f"{len(ch.hs_queue)}"
        )
        extra = self._describe_stall() if self._describe_stall is not None else ""
        return f"{state}; {extra}" if extra else state
