"""The run directory: what --overwrite may replace."""

from __future__ import annotations

import json

import pytest

from dflash_train.train.run_dir import check_run_dir, prepare_run_dir


def test_overwrite_never_replaces_a_model_s_config(tmp_path):
    """Regression: `train --out MODEL --overwrite` (the target's directory given for --out)
    replaced the model's config.json with the run's."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(ValueError, match="not a training run's"):
        check_run_dir(model, overwrite=True)
    assert json.loads((model / "config.json").read_text())["architectures"]
    # An earlier run (its config.json, as train writes it) and other files are replaced.
    run = tmp_path / "run"
    prepare_run_dir(run, False, {"model": {}, "run": {}, "note": 1})
    (run / "train.log").write_text("a tee'd log")
    prepare_run_dir(run, True, {"model": {}, "run": {}, "note": 2})
    assert json.loads((run / "config.json").read_text())["note"] == 2


def test_one_trainer_at_a_time_holds_a_run_directory(tmp_path):
    """Regression: nothing stopped a second trainer (a `--resume` of a run still training)
    from writing into the same run directory: both wrote checkpoints and metrics, one
    deleted the other's, and one died with a traceback."""
    import os

    from dflash_train.train.run_dir import lock_run_dir

    assert lock_run_dir(tmp_path / "not-yet") is None
    held = lock_run_dir(tmp_path)
    try:
        with pytest.raises(ValueError, match="in use by another training process"):
            lock_run_dir(tmp_path)
    finally:
        os.close(held)
    os.close(lock_run_dir(tmp_path))  # free again once the holder is gone
