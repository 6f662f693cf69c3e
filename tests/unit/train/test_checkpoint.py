"""Training checkpoints: atomic step directories, the newest-checkpoint link, keep-last, the
manifest that names a truncated file, and exact round trips of optimizer and RNG state."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
import torch

from dflash_train import faults
from dflash_train.model.checkpoint import load_draft
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.train import checkpoint
from dflash_train.train.checkpoint import (
    CheckpointWriter,
    list_checkpoints,
    load_resume_point,
    restore_optimizer,
    restore_rng,
    take_snapshot,
    verify,
    write_snapshot,
)


def small_model() -> DFlashDraftModel:
    cfg = DFlashConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=32,
        num_target_layers=4,
        target_layer_ids=[1, 2],
        mask_token_id=31,
        block_size=4,
    )
    model = DFlashDraftModel(cfg)
    model.init_weights(seed=0)
    return model


def trained_optimizer(model: DFlashDraftModel) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


def snapshot(model, opt, step, rows=20, epochs=2, reason="periodic"):
    done = np.zeros((epochs, rows), dtype=bool)
    done[0, : step * 2] = True
    return take_snapshot(model, opt, step, done, {"reason": reason, "total_steps": 10})


def test_a_snapshot_is_a_copy_training_may_change_afterwards(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    snap = snapshot(model, opt, 2)
    before = {k: v.clone() for k, v in snap.weights.items()}
    moments = {k: v.clone() for k, v in snap.optimizer.items()}
    trained_optimizer(model)  # training goes on while the writer thread writes
    assert all(torch.equal(before[k], v) for k, v in snap.weights.items())
    assert all(torch.equal(moments[k], v) for k, v in snap.optimizer.items())


def test_write_puts_complete_step_directories_in_place_and_links_the_newest(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    for step in (2, 4, 6, 8):
        write_snapshot(snapshot(model, opt, step), tmp_path, keep_last=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_0000008", "step_0000006"]  # keep-last 2
    link = tmp_path / "checkpoint"
    assert link.is_symlink() and link.resolve() == (tmp_path / "checkpoints/step_0000008")
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary directory left
    state = verify(tmp_path / "checkpoints/step_0000008")
    assert state["step"] == 8 and set(state["files"]) >= {"model.safetensors", "state.safetensors"}
    # eval and export read the drafter through the run directory as before
    loaded = load_draft(tmp_path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_a_half_written_checkpoint_is_never_a_candidate_and_is_cleaned_up(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    write_snapshot(snapshot(model, opt, 2), tmp_path, keep_last=0)
    partial = tmp_path / "checkpoints" / ".step_0000004.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000002"]
    assert load_resume_point(tmp_path).step == 2
    write_snapshot(snapshot(model, opt, 6), tmp_path, keep_last=0)
    assert not partial.exists()


def test_a_final_save_at_a_saved_step_rewrites_only_its_state(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    path = write_snapshot(snapshot(model, opt, 4), tmp_path, keep_last=0)
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns
    write_snapshot(snapshot(model, opt, 4, reason="finished"), tmp_path, keep_last=0)
    assert json.loads((path / "train_state.json").read_text())["reason"] == "finished"
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime
    verify(path)


def test_verify_names_a_truncated_or_missing_file(tmp_path):
    model = small_model()
    path = write_snapshot(snapshot(model, trained_optimizer(model), 2), tmp_path, keep_last=0)
    opt_file = path / "optimizer.safetensors"
    opt_file.write_bytes(opt_file.read_bytes()[:100])
    with pytest.raises(ValueError, match="optimizer.safetensors is truncated or corrupt"):
        verify(path)
    opt_file.unlink()
    with pytest.raises(ValueError, match="optimizer.safetensors is missing"):
        verify(path)
    (path / "train_state.json").write_text('{"step": 2, "fil')
    with pytest.raises(ValueError, match="train_state.json is not valid JSON"):
        verify(path)


def test_optimizer_and_data_position_round_trip_exactly(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    snap = snapshot(model, opt, 3, rows=21, epochs=3)
    write_snapshot(snap, tmp_path, keep_last=0)
    point = load_resume_point(tmp_path)
    assert point.step == 3 and point.done.shape == (3, 21) and point.done.sum() == 6
    fresh = small_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(point.weights, strict=False)
    restore_optimizer(fresh, fresh_opt, point.optimizer)
    for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    # the next update is the same from both
    grads = [torch.randn_like(p) for p in model.parameters()]
    for m, o in ((model, opt), (fresh, fresh_opt)):
        for p, g in zip(m.parameters(), grads, strict=True):
            p.grad = g.clone()
        o.step()
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )


def test_rng_states_are_restored(tmp_path):
    model = small_model()
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    write_snapshot(snapshot(model, trained_optimizer(model), 2), tmp_path, keep_last=0)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    restore_rng(load_resume_point(tmp_path))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_the_writer_runs_in_the_background_and_reports_its_errors(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    timers = StageTimers()
    writer = CheckpointWriter(tmp_path, keep_last=0, timers=timers)
    writer.submit(snapshot(model, opt, 2))
    assert writer.wait() == tmp_path / "checkpoints" / "step_0000002"
    assert timers.snapshot()[1]["checkpoint_write_s"] == 1
    faults.install([{"stage": "checkpoint_write", "action": "raise"}])
    try:
        writer.submit(snapshot(model, opt, 4))
        with pytest.raises(RuntimeError, match="writing a checkpoint failed: injected fault"):
            writer.wait()
    finally:
        faults.install(None)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000002"]
    assert load_resume_point(tmp_path).step == 2  # the failed write left the last one intact


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_that_reads(tmp_path):
    """Regression: a corrupt newest checkpoint stopped the resume although the one before it
    held a consistent pair of weights and data position."""
    from dflash_train.train.checkpoint import set_aside

    model = small_model()
    opt = trained_optimizer(model)
    for step in (2, 4, 6):
        write_snapshot(snapshot(model, opt, step), tmp_path, keep_last=0)
    root = tmp_path / "checkpoints"
    weights = root / "step_0000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    (root / "step_0000004" / "train_state.json").write_text("{not json")
    point = load_resume_point(tmp_path)
    assert point.step == 2
    (newest, why6), (older, why4) = point.skipped
    assert (newest.name, older.name) == ("step_0000006", "step_0000004")
    assert "truncated" in why6 and "not valid JSON" in why4
    moved = set_aside(tmp_path, point)
    assert [p.name for p in moved] == [".step_0000006.corrupt", ".step_0000004.corrupt"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000002"]
    assert (tmp_path / "checkpoint").resolve() == point.path.resolve()
    # A later save at step 6 writes every file again instead of keeping the corrupt ones.
    write_snapshot(snapshot(model, opt, 6), tmp_path, keep_last=0)
    verify(root / "step_0000006")


def test_with_no_readable_checkpoint_the_resume_names_each(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    for step in (2, 4):
        write_snapshot(snapshot(model, opt, step), tmp_path, keep_last=0)
        (tmp_path / "checkpoints" / f"step_{step:07d}" / "state.safetensors").unlink()
    with pytest.raises(ValueError, match="can be read: .*step_0000004.*step_0000002"):
        load_resume_point(tmp_path)


def flip_last_bytes(path) -> None:
    """Corrupt a file without changing its size: its last 4 bytes (tensor data, past the
    safetensors header) inverted."""
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
    path.write_bytes(bytes(data))


def test_the_manifest_holds_the_sha256_of_every_file_as_written(tmp_path):
    model = small_model()
    path = write_snapshot(snapshot(model, trained_optimizer(model), 2), tmp_path, keep_last=0)
    state = verify(path)
    assert set(state["sha256"]) == set(state["files"]) >= {"model.safetensors", "state.safetensors"}
    for name, digest in state["sha256"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, name


def test_a_corrupt_file_of_the_right_size_is_named_and_the_resume_falls_back(tmp_path):
    """Regression (issue 33, item 10): sizes were the only check, so a corrupt checkpoint of
    the right size loaded."""
    model = small_model()
    opt = trained_optimizer(model)
    for step in (2, 4):
        write_snapshot(snapshot(model, opt, step), tmp_path, keep_last=0)
    newest = tmp_path / "checkpoints" / "step_0000004"
    flip_last_bytes(newest / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors is corrupt: its bytes are not those"):
        verify(newest)
    point = load_resume_point(tmp_path)
    assert point.step == 2 and point.skipped[0][0] == newest
    assert "same size" in point.skipped[0][1]


def test_a_checkpoint_without_checksums_loads_by_sizes(tmp_path):
    # Written before format 3: the manifest has sizes only.
    model = small_model()
    path = write_snapshot(snapshot(model, trained_optimizer(model), 2), tmp_path, keep_last=0)
    state = json.loads((path / "train_state.json").read_text())
    del state["sha256"]
    (path / "train_state.json").write_text(json.dumps({**state, "format": 2}))
    point = load_resume_point(tmp_path)
    assert point.step == 2 and "sha256" not in point.state
    assert len(point.weights_digest()) == 64


def test_a_slow_write_is_waited_for_while_it_progresses_and_said(tmp_path, monkeypatch):
    """Regression (issue 33, item 8): the wait had one bound in all, whatever the storage."""
    monkeypatch.setattr(checkpoint, "PROGRESS_EVERY_S", 0.05)
    model = small_model()
    writer = CheckpointWriter(tmp_path, keep_last=0, timers=StageTimers())
    faults.install([{"stage": "checkpoint_write", "action": "sleep", "seconds": 0.5}])
    said: list[str] = []
    try:
        writer.submit(snapshot(model, trained_optimizer(model), 2))
        path = writer.wait(stall_s=30.0, say=said.append)
    finally:
        faults.install(None)
    assert path == tmp_path / "checkpoints" / "step_0000002"
    verify(path)
    assert said and all("checkpoint of step 2: " in line for line in said)
    assert " written in " in said[0] and said[0].endswith("still writing")


def test_a_write_that_stops_moving_is_given_up_and_abandoned_without_leftovers(tmp_path):
    model = small_model()
    opt = trained_optimizer(model)
    writer = CheckpointWriter(tmp_path, keep_last=0, timers=StageTimers())
    writer.submit(snapshot(model, opt, 2))
    writer.wait()
    faults.install([{"stage": "checkpoint_write", "action": "hang", "seconds": 1.0}])
    try:
        writer.submit(snapshot(model, opt, 4))
        thread = writer._thread
        with pytest.raises(TimeoutError, match="no byte written for 0.2s"):
            writer.wait(stall_s=0.2)
        assert writer.abandon() and not writer.busy()
        thread.join(timeout=30)  # it wakes, finds the cancel at its next chunk and cleans up
    finally:
        faults.install(None)
    assert not thread.is_alive()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000002"]
    assert writer.wait() == tmp_path / "checkpoints" / "step_0000002"  # no error left behind


def test_closing_a_run_waits_for_the_write_in_flight_past_the_stop_timeout(tmp_path):
    """Regression (issue 33, item 8): close() waited --stop-timeout for a write in flight, then
    the process could end with the daemon writer mid-write and its checkpoint lost, unsaid."""
    from types import SimpleNamespace

    from dflash_train.train.saving import RunSaver

    model = small_model()
    writer = CheckpointWriter(tmp_path, keep_last=0, timers=StageTimers())
    cfg = SimpleNamespace(
        run=SimpleNamespace(stop_timeout=0.1), pipeline=SimpleNamespace(stall_timeout=30.0)
    )
    said: list[str] = []
    saver = RunSaver(cfg, None, [], None, StageTimers(), {}, 0, said.append, writer)
    faults.install([{"stage": "checkpoint_write", "action": "sleep", "seconds": 1.0}])
    try:
        writer.submit(snapshot(model, trained_optimizer(model), 2))
        saver.close()
    finally:
        faults.install(None)
    assert not writer.busy() and said == []
    verify(tmp_path / "checkpoints" / "step_0000002")
