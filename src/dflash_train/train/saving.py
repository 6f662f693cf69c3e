"""What a run saves and when: periodic and final checkpoints of rank 0's replica with the data
position of the whole job, the save after a failure, and the check that every replica ended
with the same weights."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.config import TrainConfig
from dflash_train.devices import synchronize
from dflash_train.model.digest import target_weights_digest
from dflash_train.pipeline.build import Pipeline
from dflash_train.pipeline.distributed import NodeGroup
from dflash_train.pipeline.monitor import Accounting, StageTimers
from dflash_train.pipeline.workers import PipelineError, causes
from dflash_train.train.checkpoint import (
    CheckpointWriter,
    Snapshot,
    list_checkpoints,
    take_snapshot,
    weights_digest,
)
from dflash_train.train.replica import DraftReplica
from dflash_train.train.reporting import Diverged
from dflash_train.train.resume import Resume, target_digest
from dflash_train.train.setup import TrainingData

SIGNAL_REASON = "interrupted by "
"""How the trainer's reason for a final save begins after a stop signal ("interrupted by
SIGTERM"): that save alone is bounded by --stop-timeout."""


@dataclass
class RunSaver:
    """Checkpoints of one run. Every node calls the same methods at the same points (the data
    position is summed over nodes); rank 0 alone has a `writer` and writes."""

    cfg: TrainConfig
    data: TrainingData
    replicas: list[DraftReplica]
    pipeline: Pipeline
    timers: StageTimers
    resolved: dict[str, Any]
    total_steps: int
    say: Callable[[str], None]
    writer: CheckpointWriter | None = None
    nodes: NodeGroup | None = None
    resume: Resume | None = None
    saved_final: Path | None = None
    cache_start: dict[str, int] | None = None
    """The hybrid's rows held when the run first started (`FeatureStages.cache_start`): kept
    in every checkpoint, so a resume reads and computes the rows the uninterrupted run did."""
    weights_digest: str = ""
    abandoned: bool = False
    """A write was given up on (its storage too slow or not answering): no save is tried again."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _target_weights_digest: str = ""

    def job_accounting(self) -> Accounting:
        """The accounting of the whole job: this node's, summed over the nodes (a collective:
        every node calls it at the same point)."""
        acc = self.pipeline.accounting
        if self.nodes is None:
            return acc
        return Accounting.from_counts(self.nodes.sum_counts(acc.counts()))

    def resumed_from(self) -> list[int]:
        """The checkpoint steps this run and earlier resumes of it started from."""
        if self.resume is None:
            return []
        return [*self.resume.point.state.get("resumed_from", []), self.resume.point.step]

    def periodic(self) -> None:
        """A checkpoint written in the background (rank 0's drafter thread, after a step). The
        previous write is waited for first: one host copy of the weights and optimizer at a
        time (a snapshot taken before it ended would have made two)."""
        # The data position first: a sum over the nodes, which the other nodes' would wait
        # for (under the group's timeout) while rank 0 waits for the previous write.
        acc = self.job_accounting()
        if self.writer is not None:
            self.writer.wait(stop=self.pipeline.stop_event)
        snap = self._snapshot(acc, complete=False, reason="periodic")
        if snap is not None and self.writer is not None:
            self.writer.submit(snap, stop=self.pipeline.stop_event)

    def final(self, complete: bool, reason: str, agreed: bool | None = True) -> Path | None:
        """The final checkpoint (rank 0 writes it; every node takes part in its data
        position); its path, None on the other nodes. `agreed`: whether every replica held
        the same weights (False: saved anyway, rank 0's, so nothing trained is lost; None:
        not checked, as after a failure). After a stop signal the write may take at most
        --stop-timeout (the scheduler's grace period is running); otherwise the run waits for
        it while it makes progress (`_wait`)."""
        on_signal = reason.startswith(SIGNAL_REASON)
        deadline = time.monotonic() + self.cfg.run.stop_timeout if on_signal else None
        acc = self.job_accounting()  # every node takes part, before rank 0 waits (`periodic`)
        if self.writer is not None:
            self._wait(deadline)  # a periodic write first (its error surfaces)
        snap = self._snapshot(acc, complete, reason, agreed)
        if snap is None or self.writer is None:
            return None
        self.writer.submit(snap)
        path = self._wait(deadline)
        assert path is not None
        self.saved_final = path
        self.say(f"checkpoint ({reason}, step {self.replicas[0].step}): {path}")
        return path

    def after_failure(self, failure: BaseException | None = None) -> None:
        """Keep the weights trained so far; a failure to save must not hide the original error
        (`failure`, None when it is not known). Nothing is saved while rank 0's drafter still
        runs (its weights may be mid-update), nor after a divergence (its error says so)."""
        with self._lock:  # the main thread and the watchdog's last resort may both try
            if self.saved_final is not None or self.writer is None or self.abandoned:
                return
            if failure is not None and any(isinstance(c, Diverged) for c in causes(failure)):
                return  # the weights are not finite: never the newest checkpoint
            if self.nodes is not None:
                # The data position is the sum over nodes, and a failed node cannot add to it.
                self.say("multi-node run: no save after a failure; the newest checkpoint stands")
                return
            if "drafter-0" in self.pipeline.alive():
                self.say("warning: drafter-0 did not stop; the newest checkpoint on disk stands")
                return
            if self.replicas[0].mid_step:
                self.say(
                    "the failure came in the middle of an optimizer step: those weights may be "
                    "half updated; the newest checkpoint on disk stands"
                )
                return
            try:
                self.final(complete=False, reason="interrupted or failed", agreed=None)
            except Exception as e:  # reported, then the original error propagates
                self.say(f"warning: could not save a checkpoint after the failure: {e}")

    def _wait(self, deadline: float | None) -> Path | None:
        """Wait for the write in flight: until `deadline` (a stop signal's), else as long as it
        writes, with a progress line every `checkpoint.PROGRESS_EVERY_S` (no byte written for
        --stall-timeout: the storage is not answering). A write given up on is abandoned, said
        in the error raised: it never dies silently with the process."""
        assert self.writer is not None
        stall_s = self.cfg.pipeline.stall_timeout
        try:
            if deadline is not None:
                return self.writer.wait(timeout_s=max(0.0, deadline - time.monotonic()))
            return self.writer.wait(stall_s=stall_s, say=self.say)
        except TimeoutError as e:
            if not self.writer.abandon():  # it finished meanwhile, or is being put in place
                return self.writer.wait(stall_s=stall_s)
            self.abandoned = True
            if deadline is None:
                why = f"{e}; the storage is not answering (raise --stall-timeout if it is slow)"
            else:
                why = (
                    f"not written within --stop-timeout {self.cfg.run.stop_timeout:g}s of the "
                    f"stop ({self.writer.progress()}); give --stop-timeout (and the scheduler's "
                    "grace period) the time this storage needs"
                )
            raise self._abandoned(why) from None

    def _abandoned(self, why: str) -> PipelineError:
        """The error of an abandoned write: the run's failure, said in one line (a worker's
        error, so the command prints it without a traceback and exits 1)."""
        assert self.writer is not None
        newest = list_checkpoints(self.writer.run_dir)
        err = PipelineError(
            f"the checkpoint of step {self.writer.step} was abandoned, the newest complete "
            f"checkpoint stands: {newest[0] if newest else 'none'}; {why}"
        )
        err.worker = "checkpoint-writer"
        return err

    def replica_divergence(self) -> str | None:
        """Why the replicas do not hold the same weights, or None: every replica of every node
        must end with the same weights (they applied the same updates), and a difference is a
        bug worth stopping for. The same answer on every node (a collective: a node whose own
        replicas differ sends a digest no other node can match)."""
        for rep in self.replicas:
            synchronize(rep.device)  # their lanes' last updates are done before this thread reads
        digests = [weights_digest(rep.model) for rep in self.replicas]
        mine = digests[0]
        if len(set(digests)) != 1:
            mine = hashlib.sha256(("diverged:" + ",".join(digests)).encode()).hexdigest()
        ranks = [mine] if self.nodes is None else self.nodes.gather_text(mine)
        self.weights_digest = digests[0]
        if len(set(ranks)) == 1 and len(set(digests)) == 1:
            return None
        return f"drafter replicas diverged: weight digests {ranks} (nodes), {digests} (this node)"

    def _target_weights(self) -> str:
        """The target's weights digest (`model.digest.target_weights_digest`), computed once."""
        if not self._target_weights_digest:
            self._target_weights_digest = target_weights_digest(self.cfg.model.target)
        return self._target_weights_digest

    def close(self) -> None:
        """Wait for a write in flight (as `final` does, or abandon it, said); its failure is
        reported, not raised."""
        if self.writer is None:
            return
        try:
            self._wait(None)
        except Exception as e:  # reported; the run's own outcome stands
            self.say(f"warning: {e}")

    def _snapshot(
        self, acc: Accounting, complete: bool, reason: str, agreed: bool | None = None
    ) -> Snapshot | None:
        """Host copies of rank 0's weights, optimizer and the job's data position (`acc`, the
        job's accounting), with the run state (on the calling thread, timed as
        checkpoint_copy_s); None off rank 0."""
        t0 = time.perf_counter()
        rep, epochs = self.replicas[0], self.cfg.run.epochs
        assert not rep.mid_step, "a checkpoint of weights half way through an optimizer step"
        synchronize(rep.device)  # called on rank 0's lane or, at the end, on another thread
        if not bool(torch.stack([torch.isfinite(p).all() for p in rep.params]).all()):
            raise Diverged(  # never the newest checkpoint: a resume would start from them
                f"the drafter's weights are not finite at step {rep.step}: the run diverged "
                "(is --lr too high?); not saved, and the newest checkpoint stands"
            )
        done = np.stack([acc.trained_bitmap(e) for e in range(epochs)])
        if self.writer is None:
            return None  # this node took part in the sum above; rank 0 writes
        current = next((e for e in range(epochs) if not done[e].all()), epochs)
        state = {
            "total_steps": self.total_steps,
            "complete": complete,
            "reason": reason,
            "replicas_agree": agreed,  # None: not checked (periodic, or after a failure)
            "epoch": current,
            "epochs": epochs,
            "seed": self.cfg.run.seed,
            "trained_sequences": int(done.sum()),
            "accounting": acc.per_epoch(),
            "config": self.cfg.to_dict(),
            "resolved": self.resolved,
            "target_digest": target_digest(self.cfg.model.target),
            "target_weights_digest": self._target_weights(),
            "data_identity": self.data.dataset.identity(),
            "resumed_from": self.resumed_from(),
        }
        if self.cache_start is not None:
            state["feature_cache_start"] = self.cache_start
        snap = take_snapshot(rep.model, rep.optimizer, rep.step, done, state)
        self.timers.add("checkpoint_copy_s", time.perf_counter() - t0)
        return snap
