"""Every way a run ends closes what it opened: the metric sinks, the telemetry, every pipeline
thread; and every path that trained anything keeps the weights trained so far."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from dflash_train import faults
from dflash_train.pipeline.monitor import Accounting
from dflash_train.pipeline.workers import PipelineError
from dflash_train.train.replica import DraftReplica
from dflash_train.train.trainer import Trainer
from pipeline_helpers import (
    StopsAt,
    deterministic_train_config,
    tiny_train_config,
    write_random_dataset,
)

PIPELINE_THREADS = ("prefetch-", "target-", "drafter-", "watchdog")


class RecordingSink:
    """A metrics sink that remembers whether it was closed (and can fail on a chosen call)."""

    def __init__(self, fail_on_log: BaseException | None = None) -> None:
        self.lines: list[tuple[int, dict]] = []
        self.closed = 0
        self.fail_on_log = fail_on_log

    def log(self, step, metrics) -> None:
        if self.fail_on_log is not None:
            raise self.fail_on_log
        self.lines.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed += 1


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(PIPELINE_THREADS)]


def run_trainer(cfg, sink):
    trainer = Trainer(cfg, sink_factory=lambda _dir, _cfg: sink, log=lambda _msg: None)
    trainer.build()
    return trainer


def saved_state(run_dir) -> dict:
    return json.loads((run_dir / "checkpoint" / "train_state.json").read_text())


@pytest.fixture
def cfg(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=24)
    return tiny_train_config(tiny_target, data, tmp_path / "run", epochs=2, log_every=2)


def test_success_closes_the_sinks_and_every_thread(cfg):
    sink = RecordingSink()
    trainer = run_trainer(cfg, sink)
    result = trainer.run()
    assert result.complete and sink.lines
    assert sink.closed == 1 and pipeline_threads() == []
    assert saved_state(result.run_dir)["reason"] == "finished"
    trainer.close()  # a second close is harmless and closes nothing twice
    assert sink.closed == 1


def test_a_worker_error_closes_everything_and_keeps_the_weights(cfg, monkeypatch):
    original = DraftReplica.micro_step
    calls = {"n": 0}

    def failing(self, batch):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("injected drafter failure")
        return original(self, batch)

    monkeypatch.setattr(DraftReplica, "micro_step", failing)
    sink = RecordingSink()
    trainer = run_trainer(cfg, sink)
    with pytest.raises(PipelineError, match="injected drafter failure"):
        trainer.run()
    assert sink.closed == 1 and pipeline_threads() == []
    state = saved_state(trainer.run_dir)
    assert state["reason"] == "interrupted or failed" and state["step"] > 0


def test_an_accounting_problem_is_raised_after_saving_and_closing(cfg, monkeypatch):
    original = Accounting.problems

    def with_problem(self, complete):
        return [*original(self, complete), "injected problem"] if complete else []

    monkeypatch.setattr(Accounting, "problems", with_problem)
    sink = RecordingSink()
    trainer = run_trainer(cfg, sink)
    with pytest.raises(RuntimeError, match="PROBLEMS: injected problem"):
        trainer.run()
    assert sink.closed == 1 and pipeline_threads() == []
    state = saved_state(trainer.run_dir)
    assert state["reason"] == "accounting problem" and not state["complete"]


def test_ctrl_c_in_the_main_thread_saves_closes_and_reraises(cfg):
    sink = RecordingSink(fail_on_log=KeyboardInterrupt())
    trainer = run_trainer(cfg, sink)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert sink.closed == 1 and pipeline_threads() == []
    assert saved_state(trainer.run_dir)["reason"] == "interrupted or failed"


def test_a_sink_that_cannot_close_does_not_hide_the_result(cfg):
    class BrokenClose(RecordingSink):
        def close(self) -> None:
            super().close()
            raise OSError("disk gone")

    sink, said = BrokenClose(), []
    trainer = Trainer(cfg, sink_factory=lambda _d, _c: sink, log=said.append)
    trainer.build()
    assert trainer.run().complete
    assert sink.closed == 1 and pipeline_threads() == []
    assert any("could not close the metrics: OSError: disk gone" in line for line in said)


class StopsWhileBehind(RecordingSink):
    """At its first line (on the main thread) it waits until the step records' queue is full
    and rank 0 is blocked putting one more, stops the run as a SIGTERM does and returns once
    rank 0 has left: the main thread was behind when the signal came."""

    trainer: Trainer

    def log(self, step, metrics) -> None:
        super().log(step, metrics)
        if len(self.lines) > 1:
            return
        t, deadline = self.trainer, time.monotonic() + 120
        q = t.records._queue
        while not (q.full() and t.replicas[0].step > q.queue[-1].step):
            assert time.monotonic() < deadline, "rank 0 never filled the step records"
            time.sleep(0.01)
        t.signals.received = signal.SIGTERM
        t.pipeline.stop()
        while "drafter-0" in t.pipeline.alive():
            assert time.monotonic() < deadline, "drafter-0 did not stop"
            time.sleep(0.01)


def test_a_stop_while_the_main_thread_is_behind_still_logs_the_last_step(tiny_target, tmp_path):
    """Regression (issue 33, item 12): rank 0's record of the last step was dropped when the
    stop met a full record queue, so that step had no metric line."""
    data = write_random_dataset(tmp_path / "data", num_rows=30)  # 30 steps, more than the bound
    cfg = deterministic_train_config(tiny_target, data, tmp_path / "run")
    sink = StopsWhileBehind()
    trainer = Trainer(cfg, sink_factory=lambda _d, _c: sink, log=lambda _m: None)
    sink.trainer = trainer
    trainer.build()
    result = trainer.run()
    assert result.interrupted == "SIGTERM"
    logged = [step for step, metrics in sink.lines if "train/loss" in metrics]
    assert result.steps == saved_state(result.run_dir)["step"] > trainer.records.bound
    assert logged == list(range(1, result.steps + 1))  # every step, the last one too


def test_a_save_after_a_stop_signal_that_outlasts_the_stop_timeout_is_abandoned_and_said(
    tiny_target, tmp_path
):
    """The one bounded save (issue 33, item 8): after a stop signal the final write may take
    --stop-timeout; past it the write is abandoned (nothing half-written left, nothing put in
    place later) in one error naming the checkpoint that stands and the flag to raise."""
    data = write_random_dataset(tmp_path / "data", num_rows=30)
    cfg = deterministic_train_config(
        tiny_target, data, tmp_path / "run", save_every=2, stop_timeout=1.0
    )
    # The periodic save at step 2 is the first write, the final one at step 3 the second.
    faults.install([{"stage": "checkpoint_write", "at": 2, "action": "sleep", "seconds": 3.0}])
    try:
        trainer = StopsAt(cfg, stop_at=3, log=lambda _m: None)
        trainer.build()
        with pytest.raises(RuntimeError) as raised:
            trainer.run()
        writers = [t for t in threading.enumerate() if t.name == "checkpoint-writer"]
        for t in writers:  # it wakes, meets the cancel at its next chunk and cleans up
            t.join(timeout=30)
    finally:
        faults.install(None)
    root = tmp_path / "run" / "checkpoints"
    msg = str(raised.value)
    assert msg.startswith(
        "the checkpoint of step 3 was abandoned, the newest complete checkpoint stands: "
        f"{root / 'step_0000002'}; not written within --stop-timeout 1s of the stop ("
    )
    assert "give --stop-timeout" in msg and not any(t.is_alive() for t in writers)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]
    assert saved_state(tmp_path / "run")["step"] == 2


# ---------------------------------------------------------------- a split optimizer step
# With 2 drafters and Muon the optimizer step is split (each replica orthogonalises its share of
# the matrices; the shares are exchanged, then applied): between `apply` and the exchange a
# replica is half updated (AdamW stepped, Muon's momentum moved, Muon's matrices not).


def split_cfg(tiny_target, tmp_path, out, **overrides):
    data = write_random_dataset(tmp_path / "data", num_rows=20)
    return tiny_train_config(
        tiny_target,
        data,
        out,
        num_target_features=3,
        bucket_lengths=[128],
        hs_queue_depth=6,
        hs_min_ready=2,
        **overrides,
    )


def test_a_stop_in_the_middle_of_a_split_optimizer_step_finishes_that_step(
    tiny_target, tmp_path, monkeypatch
):
    """Regression: a stop arriving after `apply` ended the exchange, and the half-updated
    weights were saved as the step before it, so a resume trained that step's batches again
    (AdamW counters one ahead of the step)."""
    from safetensors.torch import load_file

    from pipeline_helpers import run_trainer as run_with_sinks

    begin = DraftReplica._begin_split_step
    trainers: list[Trainer] = []

    def stop_inside(self):
        begin(self)
        t = trainers[0]
        if self is t.replicas[0] and self.step == 2:
            t.signals.received = signal.SIGTERM
            t.pipeline.stop_event.set()  # what a stop does, inside the window

    class Recorded(Trainer):
        def build(self):
            trainers.append(self)
            super().build()

    monkeypatch.setattr(DraftReplica, "_begin_split_step", stop_inside)
    _, stopped = run_with_sinks(split_cfg(tiny_target, tmp_path, tmp_path / "a"), Recorded)
    monkeypatch.setattr(DraftReplica, "_begin_split_step", begin)
    _, clean = run_with_sinks(split_cfg(tiny_target, tmp_path, tmp_path / "b"), StopsAt, stop_at=3)
    assert stopped.interrupted and trainers[0].replicas[0].update_share is not None
    for result in (stopped, clean):
        state = saved_state(result.run_dir)
        counters = load_file(result.checkpoint / "optimizer.safetensors")
        adam = {int(v.item()) for k, v in counters.items() if k.endswith(".step")}
        assert (state["step"], state["trained_sequences"], adam) == (3, 12, {3})
    assert stopped.weights_digest == clean.weights_digest  # the step finished, then saved


def test_a_failure_in_the_middle_of_a_split_optimizer_step_keeps_the_newest_checkpoint(
    tiny_target, tmp_path, monkeypatch
):
    """The other replica failed after rank 0 began its step: rank 0 cannot finish it, and its
    half-updated weights are not saved; the periodic checkpoint before it stands."""
    begin = DraftReplica._begin_split_step
    said: list[str] = []
    cfg = split_cfg(tiny_target, tmp_path, tmp_path / "run", save_every=2)
    trainer = Trainer(cfg, log=said.append)

    def fail_on_rank_1(self):
        begin(self)
        if self is trainer.replicas[1] and self.step == 3:
            raise RuntimeError("injected failure in the optimizer step")

    monkeypatch.setattr(DraftReplica, "_begin_split_step", fail_on_rank_1)
    trainer.build()
    with pytest.raises(PipelineError, match="injected failure in the optimizer step"):
        trainer.run()
    assert pipeline_threads() == []
    state = saved_state(trainer.run_dir)
    assert (state["step"], state["reason"]) == (2, "periodic")
    assert any("in the middle of an optimizer step" in line for line in said)


def test_a_failure_inside_the_optimizer_step_keeps_the_newest_checkpoint(tiny_target, tmp_path):
    """Regression: an error inside `optimizer.step` (a CUDA OOM in AdamW's foreach temporaries,
    after the first parameters and moments moved) was saved as the step before it, so a resume
    trained that step's batches again on top of its update. One drafter, no split step."""
    import torch

    data = write_random_dataset(tmp_path / "data", num_rows=30)
    cfg = deterministic_train_config(tiny_target, data, tmp_path / "run", save_every=2)
    said: list[str] = []
    trainer = Trainer(cfg, log=said.append)
    trainer.build()
    rep = trainer.replicas[0]
    step = rep.optimizer.step

    def out_of_memory_half_way():
        step()  # the update happens, then the allocation after it fails
        if rep.step == 5:  # in step 6, after the periodic checkpoint of step 4
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    rep.optimizer.step = out_of_memory_half_way
    with pytest.raises(PipelineError, match="out of memory"):
        trainer.run()
    state = saved_state(trainer.run_dir)
    assert (state["step"], state["reason"]) == (4, "periodic")
    assert not (trainer.run_dir / "checkpoints" / "step_0000005").exists()  # step 6's weights
    assert any("in the middle of an optimizer step" in line for line in said)


def test_a_part_that_cannot_close_does_not_keep_the_others_open_or_hide_the_result(cfg):
    """Regression: `close` stopped at the first part that raised (the target's, copying the
    engine's log to a full disk): the metric sinks and the feature store stayed open, and the
    run's result or error was replaced by that one."""
    sink, said = RecordingSink(), []
    trainer = Trainer(cfg, sink_factory=lambda _d, _c: sink, log=said.append)
    trainer.build()

    def full_disk(_log_path=None):
        raise OSError(28, "No space left on device")

    trainer.targets.close = full_disk
    assert trainer.run().complete
    assert sink.closed == 1 and pipeline_threads() == []
    assert any("could not close the target: OSError" in line for line in said)
    trainer.close()  # again: said again, never raised
    assert sink.closed == 1


def test_a_drafter_that_does_not_stop_after_a_signal_ends_the_run_at_the_stop_timeout(cfg):
    """Regression: on one node nothing bounded the wait for the drafters after a stop signal
    (the watchdog is stopped with the pipeline): a drafter stuck in the step in flight kept the
    run alive until the scheduler killed it, with nothing said."""
    release = threading.Event()

    signalled = []

    class StuckAfterSignal(Trainer):
        def on_step(self, outcome, grad_norm):
            super().on_step(outcome, grad_norm)
            if self.replicas[0].step == 2:
                signalled.append(time.monotonic())
                self.signals.received = signal.SIGTERM  # as the handler does
                release.wait(60)  # drafter-0 stuck (a long evaluation, a hung device call)

    cfg.run.stop_timeout = 3.0
    trainer = StuckAfterSignal(cfg, log=lambda _m: None)
    trainer.build()
    try:
        with pytest.raises(RuntimeError, match=r"drafter-0 still running\) did not stop within"):
            trainer.run()
        # One --stop-timeout bounds the whole stop: the joins after it (the failure path's,
        # close's) each waited for another one before (9 s here).
        assert time.monotonic() - signalled[0] < 3.0 + 2.0
    finally:
        release.set()
        trainer.pipeline.join(timeout_s=30)
    assert pipeline_threads() == []


def test_a_main_thread_stuck_after_a_stop_signal_is_ended_by_the_stop_guard(cfg, monkeypatch):
    """Regression: the watchdog is stopped with the pipeline, so after a stop signal nothing
    watched the main thread: a metric backend that hung on the last lines kept the run alive,
    unsaved, until the scheduler killed it. The stop guard saves and exits 124."""
    import os

    from dflash_train.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "STOP_GUARD_SLACK_S", 1.0)
    release, exits, said = threading.Event(), [], []

    class HangsAfterTheSignal(RecordingSink):
        def log(self, step, metrics):
            if trainer._stopping:
                release.wait(60)  # W&B not answering
            super().log(step, metrics)

    class SignalAt2(Trainer):
        def on_step(self, outcome, grad_norm):
            super().on_step(outcome, grad_norm)
            if self.replicas[0].step == 2:
                self.signals.received = signal.SIGTERM  # as the handler does

    def exit_(code):
        exits.append((code, saved_state(trainer.run_dir)))
        release.set()  # the test's process goes on: the main thread is let go

    monkeypatch.setattr(os, "_exit", exit_)
    cfg.run.stop_timeout = 1.0
    cfg.run.log_every = 3  # step 2's line is logged at the end, after the signal
    trainer = SignalAt2(cfg, log=said.append, sink_factory=lambda _d, _c: HangsAfterTheSignal())
    trainer.build()
    t0 = time.monotonic()
    try:
        trainer.run()
    except Exception:
        pass  # after the guard's exit: whatever the let-go main thread makes of it
    finally:
        release.set()
    assert exits and exits[0][0] == 124 and time.monotonic() - t0 < 30
    state = exits[0][1]
    assert state["reason"] == "interrupted or failed" and state["step"] >= 2
    assert any("the run did not end within 4s of SIGTERM" in line for line in said)


def test_the_last_resort_exits_even_when_it_cannot_say_so(cfg, monkeypatch):
    """Regression: with stderr gone (a closed pipe), the last resort's first line raised and
    its thread died before os._exit: the hung run hung on."""
    import os

    class Exited(BaseException):
        pass

    def exit_(code):
        raise Exited(code)

    def broken_pipe(_message):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(os, "_exit", exit_)
    trainer = Trainer(cfg, log=lambda _m: None)
    trainer.build()
    trainer.say = broken_pipe
    try:
        with pytest.raises(Exited) as e:
            trainer._last_resort()
        assert e.value.args == (124,)
    finally:
        trainer.close()


def test_every_node_sums_the_data_position_before_rank_0_waits_for_a_write(cfg):
    """Regression: rank 0 waited for the previous checkpoint's write (as long as it made
    progress) before the data position's sum over the nodes, where the others waited under
    the group's timeout: a write longer than --stall-timeout failed the final save."""
    order = []

    class Nodes:
        def sum_counts(self, counts):
            order.append("sum")
            return counts

    trainer = Trainer(cfg, log=lambda _m: None)
    trainer.build()
    try:
        saver = trainer.saver
        saver.nodes = Nodes()
        wait, _wait = saver.writer.wait, saver._wait
        saver.writer.wait = lambda **kw: order.append("wait") or wait(**kw)
        saver._wait = lambda deadline: order.append("wait") or _wait(deadline)
        saver.periodic()
        assert order[:2] == ["sum", "wait"]
        order.clear()
        saver.final(complete=False, reason="test")
        assert order[:2] == ["sum", "wait"]
    finally:
        trainer.close()


def test_a_periodic_save_waits_for_the_write_before_it_before_copying(cfg, monkeypatch):
    """One host copy of the weights and optimizer at a time: a periodic snapshot taken while
    the previous write ran held two (found in review)."""
    from dflash_train.train import saving

    take = saving.take_snapshot
    trainers: list[Trainer] = []
    busy_at_copy: list[bool] = []

    def recording(*args, **kwargs):
        busy_at_copy.append(trainers[0].saver.writer.busy())
        return take(*args, **kwargs)

    class Recorded(Trainer):
        def build(self):
            trainers.append(self)
            super().build()

    monkeypatch.setattr(saving, "take_snapshot", recording)
    faults.install(
        [{"stage": "checkpoint_write", "every": True, "action": "sleep", "seconds": 0.3}]
    )
    try:
        cfg.run.save_every = 1
        trainer = Recorded(cfg, log=lambda _m: None)
        trainer.build()
        assert trainer.run().complete
    finally:
        faults.install(None)
    assert len(busy_at_copy) > 3 and not any(busy_at_copy)


def test_a_build_that_fails_after_the_targets_started_closes_them(cfg, monkeypatch):
    """Regression: the targets were recorded only once the drafters were built, so a drafter
    that failed to build (out of memory, a bad --init-from) left an engine running, its
    GPUs held, until the process ended."""
    from dflash_train.train import models
    from dflash_train.train import trainer as trainer_module

    closed: list[bool] = []
    monkeypatch.setattr(models.Targets, "close", lambda self, _log=None: closed.append(True))

    def no_memory(*_args, **_kwargs):
        raise RuntimeError("out of memory building the drafters")

    monkeypatch.setattr(trainer_module, "build_replicas", no_memory)
    trainer = Trainer(cfg, log=lambda _m: None)
    with pytest.raises(RuntimeError, match="out of memory building the drafters"):
        trainer.build()
    trainer.close()
    assert closed == [True]


def test_a_diverged_run_stops_in_one_line_and_saves_no_weights_that_are_not_finite(
    tiny_target, tmp_path
):
    """Regression: a learning rate of 1e30 trained to NaN weights, and the run "finished",
    saved them, and exported a drafter that eval scored at tau 1.0 with no warning."""
    import torch
    from safetensors.torch import load_file

    from dflash_train.train.reporting import Diverged

    data = write_random_dataset(tmp_path / "data", num_rows=30)
    # Seen by the loss at a log step, or by a periodic save before any log step.
    cases = (
        ("logged", {"save_every": 0}, "the training loss is nan"),
        ("saved", {"save_every": 1, "log_every": 50}, "diverged"),
    )
    for out, every, said in cases:
        cfg = deterministic_train_config(
            tiny_target, data, tmp_path / out, lr=1e30, optimizer="adamw", **every
        )
        lines: list[str] = []
        trainer = Trainer(cfg, log=lines.append)
        trainer.build()
        with pytest.raises((Diverged, PipelineError), match=said):
            trainer.run()
        # Its error says the newest checkpoint stands: no second line saying so as a warning.
        assert not [ln for ln in lines if "could not save" in ln], lines
        root = tmp_path / out / "checkpoints"
        for ckpt in root.iterdir() if root.exists() else ():
            weights = load_file(ckpt / "model.safetensors")
            assert all(torch.isfinite(w).all() for w in weights.values()), ckpt
