"""Nothing paid for is lost: a stopped run resumes exactly (same losses when the pipeline is
deterministic, every sequence once when it is not), a crash during a save falls back to the
previous checkpoint, SIGTERM stops in order, and bad resumes change nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_train.cli import main as cli
from dflash_train.train.resume import resume_config
from dflash_train.train.trainer import Trainer
from pipeline_helpers import (
    StopsAt,
    deterministic_train_config,
    fine_tune,
    tiny_train_config,
    write_random_dataset,
)

ROWS = 30


def metrics_of(run_dir: Path) -> dict[int, dict]:
    """The last logged line of every step (a resumed run appends to the same file)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec
    return out


def run(cfg, cls=Trainer, resume=None, **kwargs):
    trainer = cls(cfg, log=lambda _m: None, resume=resume, **kwargs)
    trainer.build()
    return trainer, trainer.run()


def from_jsonl_logger(cfg):
    from dflash_train.train.command import metrics_sink

    return metrics_sink(cfg)


# The other position weights and optimizer too: Muon's momentum and AdamW's moments both come
# back from the checkpoint, and D-PACE's weights are recomputed from the restored drafter.
OTHER_OBJECTIVE = {"position_weights": "dpace", "optimizer": "muon", "muon_lr": 1e-3}
# A loss on the target's distribution: its teacher's input travels with the features.
TEACHER_OBJECTIVE = {"loss": "lk_lambda", "position_weights": "dpace"}


@pytest.mark.parametrize(
    "objective",
    [{}, OTHER_OBJECTIVE, TEACHER_OBJECTIVE],
    ids=["defaults", "dpace_muon", "lk_lambda"],
)
def test_a_stopped_and_resumed_run_has_the_uninterrupted_runs_losses(
    tiny_target, tmp_path, objective
):
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    full_cfg = deterministic_train_config(tiny_target, data, tmp_path / "full", **objective)
    _, full = run(full_cfg, sink_factory=from_jsonl_logger(full_cfg))
    assert full.complete and full.steps == 30  # 15 batches of 2 per epoch, 2 epochs

    cfg = deterministic_train_config(tiny_target, data, tmp_path / "resumed", **objective)
    _, first = run(cfg, StopsAt, stop_at=11, sink_factory=from_jsonl_logger(cfg))
    assert first.interrupted == "SIGTERM" and first.steps == 11 and not first.complete
    cfg2, resume = resume_config(tmp_path / "resumed", {})
    _, second = run(cfg2, resume=resume, sink_factory=from_jsonl_logger(cfg2))
    assert second.complete and second.steps == 30 and second.resumed_from == [11]

    want, got = metrics_of(tmp_path / "full"), metrics_of(tmp_path / "resumed")
    for step in range(12, 31):
        assert got[step]["train/loss"] == pytest.approx(want[step]["train/loss"], abs=1e-5), step
        assert got[step]["train/lr"] == pytest.approx(want[step]["train/lr"], rel=1e-9)
    epochs = second.per_epoch
    assert [e["trained"] for e in epochs] == [ROWS, ROWS]
    assert all(e["trained_exactly_once"] for e in epochs)


def test_every_sequence_is_trained_once_across_a_stop_with_two_drafters(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", epochs=2, mix="stratified")
    _, first = run(cfg, StopsAt, stop_at=5)
    assert first.interrupted and 0 < sum(e["trained"] for e in first.per_epoch) < 2 * ROWS
    cfg2, resume = resume_config(tmp_path / "run", {"hs_queue_depth": 6, "hs_min_ready": 2})
    assert cfg2.pipeline.hs_queue_depth == 6  # a safe change is taken
    trainer, second = run(cfg2, resume=resume)
    assert second.complete and "all match" in second.accounting
    assert [e["trained"] for e in second.per_epoch] == [ROWS, ROWS]
    assert all(e["trained_exactly_once"] for e in second.per_epoch)
    assert trainer.pipeline.accounting.problems(complete=True) == []


def test_a_finished_run_resumed_with_a_longer_schedule_trains_no_more_than_its_data(
    tiny_target, tmp_path
):
    data = write_random_dataset(tmp_path / "data", num_rows=20)
    cfg = tiny_train_config(
        tiny_target, data, tmp_path / "run", epochs=2, max_steps=4, bucket_lengths=[128]
    )
    _, first = run(cfg)
    assert first.steps == 4 and not first.complete
    with pytest.raises(ValueError, match="max_steps: 4 -> 3 .*may only be extended"):
        resume_config(tmp_path / "run", {"max_steps": 3})
    cfg2, resume = resume_config(tmp_path / "run", {"max_steps": 100})
    _, second = run(cfg2, resume=resume)
    assert second.complete and second.steps == 10  # 2 epochs of 5 batches x 2 drafters


class DivergesAtTheEnd(Trainer):
    """A trainer whose second replica's weights change after the last step (as a bug would)."""

    def on_step(self, outcome, grad_norm) -> None:
        super().on_step(outcome, grad_norm)
        if self.replicas[0].step == self.total_steps:
            import torch

            with torch.no_grad():
                self.replicas[1].model.fc.weight.add_(1.0)


def test_diverged_replicas_are_saved_first_marked_then_the_run_stops(tiny_target, tmp_path):
    """Regression: the agreement check ran before the final save, so a mismatch lost every
    step trained since the last periodic checkpoint."""
    data = write_random_dataset(tmp_path / "data", num_rows=12)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", max_steps=3)
    with pytest.raises(RuntimeError, match="drafter replicas diverged"):
        run(cfg, DivergesAtTheEnd)
    state = json.loads((tmp_path / "run" / "checkpoint" / "train_state.json").read_text())
    assert state["step"] == 3 and state["reason"] == "replicas diverged"
    assert state["replicas_agree"] is False and not state["complete"]
    # Exported anyway, the drafter says what it is: rank 0's weights of replicas that diverged.
    from dflash_train.export import export_draft

    with pytest.warns(UserWarning, match=r"step 3\) was saved because the drafter replicas div"):
        export_draft(tmp_path / "run", tmp_path / "out")
    # A finished run's final checkpoint, and a periodic one, export without a word.
    finished = tmp_path / "finished"
    run(tiny_train_config(tiny_target, data, finished, max_steps=2, save_every=1))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_draft(finished, tmp_path / "out2")
        export_draft(finished / "checkpoints" / "step_0000001", tmp_path / "out3")


# ----------------------------------------------------------------------------- subprocesses
def train_argv(target, data, out, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "dflash_train", "train",
        "--target", str(target), "--data", str(data), "--out", str(out),
        "--target-devices", "cpu", "--drafter-devices", "cpu,cpu",
        "--draft-layers", "1", "--block-size", "8", "--num-anchors", "16",
        "--num-target-features", "3", "--mask-token-id", "255", "--batch-size", "2",
        "--hs-queue-depth", "8", "--hs-min-ready", "4", "--num-prefetchers", "2",
        "--no-progress", "--cpu-threads", "1", "--log-every", "1",
        *extra,
    ]  # fmt: skip


def start(argv, faults=None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("DFLASH_FAULTS", None)
    if faults:
        env["DFLASH_FAULTS"] = json.dumps(faults)
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(predicate, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((json.loads(x)["step"] for x in path.read_text().splitlines() if x), default=0)


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    out = tmp_path / "run"
    argv = train_argv(tiny_target, data, out, "--epochs", "2", "--save-every", "2")
    # The second periodic save (step 4) hangs after writing its weights: kill it there.
    proc = start(argv, faults=[{"stage": "checkpoint_write", "at": 2, "action": "hang"}])
    partial = out / "checkpoints" / ".step_0000004.tmp"
    wait_for(lambda: (partial / "optimizer.safetensors").is_file(), 120, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (out / "checkpoints" / "step_0000002").is_dir() and partial.is_dir()
    assert os.readlink(out / "checkpoint") == "checkpoints/step_0000002"

    resumed = subprocess.run([*argv[:4], "--resume", str(out)], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "step_0000002 (step 2;" in resumed.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["complete"] and result["resumed_from_steps"] == [2]
    assert result["accounting"]["finished_epochs_trained_exactly_once"]
    assert not partial.exists()


def test_sigterm_writes_a_checkpoint_exits_in_bounds_and_resume_finishes(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    out = tmp_path / "run"
    argv = train_argv(tiny_target, data, out, "--epochs", "2", "--stop-timeout", "30")
    slow = [{"stage": "drafter_step", "action": "sleep", "seconds": 0.2, "every": True}]
    proc = start(argv, faults=slow)
    wait_for(lambda: logged_steps(out) >= 2, 120, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, "the run did not stop within --stop-timeout"
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr and f"--resume {out}" in stderr
    result = json.loads((out / "result.json").read_text())
    assert result["interrupted"] == "SIGTERM" and result["resume_command"].endswith(str(out))
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "interrupted by SIGTERM" and state["step"] == result["steps"] > 0

    resumed = subprocess.run(
        [*argv[:4], "--resume", str(out), "--hs-queue-depth", "10"], capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["complete"] and result["accounting"]["trained"] == 2 * ROWS
    assert result["accounting"]["finished_epochs_trained_exactly_once"]


# ----------------------------------------------------------------------------- bad input
def tree(root: Path) -> dict[str, str]:
    """Every file under `root` with a digest of its bytes (what 'nothing changed' means)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    data = write_random_dataset(root / "data", num_rows=12)
    cfg = tiny_train_config(tiny_target, data, root / "run", max_steps=2)
    run(cfg)
    return root / "run", data


def expect_refused(capsys, argv, needle: str) -> None:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_resume_without_a_checkpoint_is_one_line_and_changes_nothing(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    before = tree(tmp_path)
    expect_refused(capsys, ["train", "--resume", str(tmp_path / "run")], "has no checkpoint")
    expect_refused(capsys, ["train", "--resume", str(tmp_path / "none")], "does not exist")
    assert tree(tmp_path) == before


def test_resume_refuses_unsafe_changes_listing_each(finished_run, capsys):
    run_dir, _ = finished_run
    before = tree(run_dir)
    expect_refused(
        capsys,
        ["train", "--resume", str(run_dir), "--block-size", "4", "--num-anchors", "8", "--lr", "1"],
        "block_size: 8 -> 4; num_anchors: 16 -> 8; lr: 0.0006 -> 1.0",
    )
    expect_refused(
        capsys, ["train", "--resume", str(run_dir), "--drafter-devices", "cpu"], "2 -> 1 devices"
    )
    assert tree(run_dir) == before


def test_resume_with_another_node_count_keeps_the_drafters_in_all(finished_run, monkeypatch):
    """Regression: only the local drafter count was compared, so a resume on more nodes doubled
    the global batch per step under the saved schedule (an lr curve for another run)."""
    run_dir, _ = finished_run  # 1 node x 2 drafters
    with pytest.raises(ValueError, match=r"2 -> 4 devices in all \(1 node\(s\) x 2 -> 2 x 2"):
        resume_config(run_dir, {}, world_size=2)
    cfg, resume = resume_config(run_dir, {"drafter_devices": ["cpu"]}, world_size=2)
    assert cfg.pipeline.drafter_devices == ["cpu"]  # 2 nodes x 1: the same global batch
    from dflash_train.train.resume import node_count_note

    assert "sharded over 2" in node_count_note(resume.point, 2)[0]
    assert node_count_note(resume.point, 1) == []
    # torchrun sets WORLD_SIZE: the command compares the job's nodes, not only this node's.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli(["train", "--resume", str(run_dir)]) == 2


def test_resume_with_the_default_drafters_counts_what_this_machine_resolves(tiny_target, tmp_path):
    """Regression: a run started without --drafter-devices saves none, and the check compared
    the checkpoint's resolved count with itself, so a resume on a node with other GPUs (or
    another CUDA_VISIBLE_DEVICES) trained another global batch per step unrefused."""
    data = write_random_dataset(tmp_path / "data", num_rows=12)
    cfg = tiny_train_config(
        tiny_target, data, tmp_path / "run", drafter_devices=None, target_devices=None, max_steps=2
    )
    run(cfg)
    state_file = tmp_path / "run" / "checkpoint" / "train_state.json"
    state = json.loads(state_file.read_text())
    assert state["config"]["pipeline"]["drafter_devices"] is None
    assert state["resolved"]["drafter_devices"] == ["cpu"]  # this machine's default: 1
    resume_config(tmp_path / "run", {})  # the same machine: the same count
    state["resolved"]["drafter_devices"] = ["cuda:1", "cuda:2"]  # as started on another node
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"2 -> 1 devices in all"):
        resume_config(tmp_path / "run", {})


def test_resume_refuses_another_fine_tune_with_the_same_config(finished_run, tmp_path):
    """Regression: the target was recognised by its config.json alone."""
    run_dir, _ = finished_run
    saved = json.loads((run_dir / "config.json").read_text())["model"]["target"]
    before = tree(run_dir)
    tuned = tmp_path / "tuned"
    fine_tune(Path(saved), tuned, "layers.0.self_attn.q_proj", "start")
    with pytest.raises(ValueError, match="holds other weights than the model the run trained"):
        resume_config(run_dir, {"target": str(tuned)})
    moved = tmp_path / "moved"
    shutil.copytree(saved, moved)
    cfg, _ = resume_config(run_dir, {"target": str(moved)})  # the same model, elsewhere
    assert cfg.model.target == str(moved) and tree(run_dir) == before


def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    cfg = deterministic_train_config(tiny_target, data, tmp_path / "run", save_every=4)
    run(cfg, StopsAt, stop_at=10)  # checkpoints at steps 4, 8 and 10
    newest = tmp_path / "run" / "checkpoints" / "step_0000010"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    cfg2, resume = resume_config(tmp_path / "run", {})
    assert resume.point.step == 8 and resume.point.skipped[0][0] == newest
    said: list[str] = []
    trainer = Trainer(cfg2, log=said.append, resume=resume)
    trainer.build()
    second = trainer.run()
    assert any(f"{newest} cannot be read" in line and "step_0000008" in line for line in said)
    assert second.complete and second.resumed_from == [8]
    assert all(e["trained_exactly_once"] for e in second.per_epoch)
    assert (tmp_path / "run" / "checkpoints" / ".step_0000010.corrupt").is_dir()


def test_resume_refuses_a_change_of_architecture_or_dflash2_sizes(finished_run, capsys):
    # The DFlash 2 settings are model shape: a resumed run keeps the drafter it trained.
    run_dir, _ = finished_run
    before = tree(run_dir)
    argv = ["train", "--resume", str(run_dir), "--arch", "dflash2", "--selector-top-k", "8"]
    expect_refused(capsys, argv, "arch: 'dflash' -> 'dflash2'; selector_top_k: 16 -> 8")
    assert tree(run_dir) == before


def test_resume_refuses_a_drafter_built_otherwise_than_the_checkpoints(
    finished_run, capsys, monkeypatch
):
    """The same flags can build another drafter (a tokenizer with another mask id, a changed
    --init-from source, code that derives a field otherwise): its weights would load, shapes
    alike, into another architecture. The checkpoint's draft_config.json is the reference."""
    import dataclasses

    from dflash_train.train import setup

    run_dir, _ = finished_run
    before = tree(run_dir)
    derive = setup.draft_config_for

    def otherwise(*args, **kwargs):
        config, how = derive(*args, **kwargs)
        return dataclasses.replace(config, rms_norm_eps=1e-3), how

    monkeypatch.setattr(setup, "draft_config_for", otherwise)
    expect_refused(
        capsys, ["train", "--resume", str(run_dir)], "trained another drafter than this run"
    )
    assert tree(run_dir) == before
    monkeypatch.setattr(setup, "draft_config_for", derive)
    cfg, resume = resume_config(run_dir, {})
    assert resume.point.drafter_changes(setup.draft_config_for(cfg.model)[0]) == []


def test_resume_refuses_a_change_of_the_position_weights_or_the_optimizer(finished_run, capsys):
    # They change what is trained: the objective's gradient, the update rule and its state.
    from dflash_train.config import ObjectiveOptions, OptimOptions

    run_dir, _ = finished_run
    before = tree(run_dir)
    obj, opt = ObjectiveOptions(), OptimOptions()
    weights = {"decay": "dpace", "dpace": "decay"}[obj.position_weights]
    optimizer = {"adamw": "muon", "muon": "adamw"}[opt.optimizer]
    argv = ["train", "--resume", str(run_dir), "--position-weights", weights]
    argv += ["--dpace-alpha", "0.25", "--optimizer", optimizer]
    expect_refused(
        capsys,
        argv,
        f"position_weights: {obj.position_weights!r} -> {weights!r}; dpace_alpha: "
        f"{obj.dpace_alpha} -> 0.25; optimizer: {opt.optimizer!r} -> {optimizer!r}",
    )
    argv = ["train", "--resume", str(run_dir), "--muon-lr", "0.01"]
    expect_refused(capsys, argv, "muon_lr: None -> 0.01")
    assert tree(run_dir) == before


def test_a_checkpoint_from_before_the_objective_flags_resumes_with_decay_and_adamw():
    from dflash_train.train.resume import _with_old_objective

    old = {"objective": {"num_anchors": 16}, "optim": {"lr": 1e-3}, "run": {"seed": 0}}
    got = _with_old_objective(old)
    assert got["objective"] == {"num_anchors": 16, "position_weights": "decay"}
    assert got["optim"] == {"lr": 1e-3, "optimizer": "adamw"} and got["run"] == old["run"]
    assert old["objective"] == {"num_anchors": 16}  # the saved dict itself is left alone
    new = {"objective": {"position_weights": "dpace"}, "optim": {"optimizer": "muon"}}
    assert _with_old_objective(new) == new


def test_resume_names_a_truncated_or_corrupt_file(finished_run, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(finished_run[0], run_dir, symlinks=True)
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    before = tree(run_dir)
    expect_refused(capsys, ["train", "--resume", str(run_dir)], f"{weights} is truncated")
    assert tree(run_dir) == before
    (newest / "train_state.json").write_text("{not json")
    before = tree(run_dir)
    expect_refused(capsys, ["train", "--resume", str(run_dir)], "train_state.json is not valid")
    assert tree(run_dir) == before


def test_a_run_directory_with_checkpoints_needs_resume_or_overwrite(
    finished_run, tiny_target, capsys
):
    run_dir, data = finished_run
    before = tree(run_dir)
    argv = ["train", "--target", str(tiny_target), "--data", str(data), "--out", str(run_dir)]
    expect_refused(capsys, argv, f"continue it with `dflash-train train --resume {run_dir}`")
    assert tree(run_dir) == before


def test_a_resumed_run_plans_with_the_measured_share_without_measuring_again(
    tiny_target, tmp_path, monkeypatch
):
    from dflash_train.pipeline.costing import CostFit

    fit = CostFit(0.0, 1e-6, 1e-6, 0.5, [])
    monkeypatch.setattr("dflash_train.train.trainer.measure_batch_cost", lambda rep, data: fit)
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", epochs=2, batch_cost="auto")
    first, stopped = run(cfg, StopsAt, stop_at=4)
    assert stopped.steps == 4 and first.cfg.pipeline.batch_cost == "0.5"

    def measure_again(rep, data):
        raise AssertionError("a resumed run must plan with its recorded share")

    monkeypatch.setattr("dflash_train.train.trainer.measure_batch_cost", measure_again)
    # Its own command line given again (regression: `auto` was refused as '0.5' -> 'auto').
    cfg2, resume = resume_config(tmp_path / "run", {"batch_cost": "auto"})
    assert cfg2.pipeline.batch_cost == "0.5"
    second, done = run(cfg2, resume=resume)
    assert second.data.plans.batching.token_share == 0.5
    assert done.complete and all(e["trained_exactly_once"] for e in done.per_epoch)
    assert [e["trained"] for e in done.per_epoch] == [ROWS, ROWS]


def test_a_resumed_run_plans_the_buckets_its_first_launch_fitted(
    tiny_target, tmp_path, monkeypatch
):
    """Regression: under --batch-cost flops or auto with buckets chosen from the data, the
    first launch fitted its buckets before the share was known, a resume with the share it
    recorded: other buckets, other batches. A resume then either stopped ('epoch 0 batch N is
    partly trained') or trained batches its resume state did not name."""
    from dflash_train.pipeline.costing import CostFit

    fit = CostFit(0.0, 1e-6, 1e-6, 0.5, [])
    monkeypatch.setattr("dflash_train.train.trainer.measure_batch_cost", lambda rep, data: fit)
    data = share_sensitive_data(tmp_path)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", batch_cost="auto")
    first, stopped = run(cfg, StopsAt, stop_at=6)
    assert stopped.steps == 6 and first.cfg.pipeline.bucket_lengths is None
    # Its own command line given again (regression: refused as '0.5' -> 'auto').
    cfg2, resume = resume_config(tmp_path / "run", {"batch_cost": "auto"})
    second, done = run(cfg2, resume=resume)
    assert second.data.bucket_lengths == first.data.bucket_lengths
    assert second.data.plans.batching.token_share == 0.5
    assert done.complete and all(e["trained_exactly_once"] for e in done.per_epoch)
    assert [e["trained"] for e in done.per_epoch] == [100]


def share_sensitive_data(tmp_path):
    """Rows whose buckets, chosen from the data, differ when fitted with token share 0.5
    rather than 0 (at the 2 draws per step of `tiny_train_config`)."""
    return write_random_dataset(tmp_path / "data", num_rows=100, max_len=300, seed=0)


def test_the_recorded_share_given_to_a_new_run_plans_the_same_batches(tiny_target, tmp_path):
    """Regression: what a run says of the share it settled on ('--batch-cost 0.5 plans the
    same batches again') was false with buckets chosen from the data: an explicit share fitted
    the buckets with itself, flops and auto by block positions (the share was not known)."""
    from dflash_train.train.setup import TrainingData

    data = share_sensitive_data(tmp_path)
    auto = tiny_train_config(tiny_target, data, tmp_path / "a", batch_cost="auto")
    first = TrainingData.load(auto).with_token_share(0.5)  # as the trainer plans once measured
    again = tiny_train_config(tiny_target, data, tmp_path / "b", batch_cost="0.5")
    second = TrainingData.load(again)
    assert second.bucket_lengths == first.bucket_lengths
    assert second.plans.epoch(0) == first.plans.epoch(0)


def test_a_checkpoint_from_before_batch_cost_resumes_planned_by_blocks():
    from dflash_train.train.resume import _with_old_defaults

    old = {"pipeline": {"batching": "work"}, "run": {"seed": 0}}
    assert _with_old_defaults(old)["pipeline"] == {"batching": "work", "batch_cost": "blocks"}
    assert old["pipeline"] == {"batching": "work"}  # the saved dict itself is left alone
    new = {"pipeline": {"batching": "work", "batch_cost": "0.25"}}
    assert _with_old_defaults(new) == new


class ScheduleCutShort(Trainer):
    """A trainer whose schedule ends one step before its data does (as issue 33's multi-rank
    schedule did), without --max-steps and without a stop."""

    def _total_steps(self) -> int:
        steps = super()._total_steps()
        return steps - 1


def test_a_run_that_leaves_rows_untrained_never_ends_as_if_it_finished(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=ROWS)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", epochs=1)
    trainer = ScheduleCutShort(cfg, log=lambda _m: None)
    trainer.build()
    with pytest.raises(RuntimeError, match="ended with rows untrained"):
        trainer.run()
    state = json.loads((tmp_path / "run" / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "rows left untrained"  # the weights trained are saved, marked
    cfg2, resume = resume_config(tmp_path / "run", {})
    _, second = run(cfg2, resume=resume)  # the resume trains what was left, once
    assert second.complete and all(e["trained_exactly_once"] for e in second.per_epoch)


def test_a_run_still_training_cannot_be_resumed_or_overwritten_beside_it(finished_run, tmp_path):
    """A second trainer on a run directory another holds is refused before it reads or
    replaces anything (the lock a training process holds, taken here by hand)."""
    import os

    from dflash_train.train.run_dir import lock_run_dir

    run_dir, _ = finished_run
    before = tree(run_dir)
    held = lock_run_dir(run_dir)
    try:
        cfg, resume = resume_config(run_dir, {})
        with pytest.raises(ValueError, match="in use by another training process"):
            Trainer(cfg, log=lambda _m: None, resume=resume).build()
        assert cli(["train", "--resume", str(run_dir)]) == 2
        assert tree(run_dir) == before
    finally:
        os.close(held)
