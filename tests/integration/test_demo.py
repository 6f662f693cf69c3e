"""`dflash-train demo`: the whole product end to end (slow), and its cheap deterministic parts:
the target cache, the target's batching, the commands it runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_train import demo, demo_target
from dflash_train.demo import DemoPaths, ensure_target, quick_preset, write_corpus
from dflash_train.demo_target import TargetSpec, collate, length_batches

TINY_TARGET = TargetSpec(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    steps=2,
    batch_tokens=512,
    warmup_steps=1,
)


def tiny_preset(**target_changes) -> demo.DemoPreset:
    return dataclasses.replace(
        quick_preset(),
        train_conversations=30,
        heldout_prompts=2,
        vocab_size=320,
        target=dataclasses.replace(TINY_TARGET, **target_changes),
    )


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_quick_demo_runs_every_stage_and_reaches_tau_above_1_5(tmp_path):
    out = tmp_path / "demo"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paths = DemoPaths(out)
    assert (paths.tokenizer / "tokenizer.json").is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "demo_fingerprint.json"):
        assert (paths.target / name).is_file(), name
    assert json.loads((paths.prepared / "summary.json").read_text())["num_rows"] > 0
    assert (paths.run / "metrics.jsonl").stat().st_size > 0
    assert (paths.run / "checkpoint" / "model.safetensors").is_file()
    assert json.loads((paths.drafter / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"
    ]
    assert (paths.drafter / "model.safetensors").is_file()
    assert paths.report.is_file()
    report = json.loads(paths.eval_json.read_text())
    assert report["block_size"] == 16
    assert report["tau"] > 1.5, report["tau"]
    # The summary names the artefacts and shows the commands for a real model.
    assert str(paths.drafter) in proc.stdout and str(paths.report) in proc.stdout
    assert "dflash-train train --target /models/Qwen3-8B" in proc.stdout
    assert "--hs-queue-depth" in proc.stdout  # the queue knobs are visible
    print(f"demo --quick: {wall:.0f} s wall, tau {report['tau']:.2f}")


# ---------------------------------------------------------------------------- target cache


def test_a_second_run_with_the_same_settings_reuses_the_target(tmp_path, monkeypatch):
    preset = tiny_preset()
    paths = DemoPaths(tmp_path)
    train, heldout = write_corpus(paths, preset)
    lines: list[str] = []
    first, _ = ensure_target(paths, preset, train, heldout, log=lines.append)
    assert not first.cached
    assert (paths.target / "model.safetensors").is_file()

    def no_training(*_args, **_kwargs):
        raise AssertionError("the target was trained again")

    monkeypatch.setattr(demo_target, "train_lm", no_training)
    lines.clear()
    second, _ = ensure_target(paths, preset, train, heldout, log=lines.append)
    assert second.cached
    assert second.token_accuracy == first.token_accuracy
    assert any("target cached" in line for line in lines)


@pytest.mark.parametrize(
    "change",
    [
        {"target_changes": {"steps": 3}},
        {"target_changes": {"seed": 1}},
        {"train_conversations": 31},  # another corpus
        {"vocab_size": 330},  # another tokenizer
    ],
)
def test_changing_any_setting_trains_the_target_again(tmp_path, change):
    paths = DemoPaths(tmp_path)
    preset = tiny_preset()
    ensure_target(paths, preset, *write_corpus(paths, preset), log=lambda _line: None)
    changed = tiny_preset(**change.get("target_changes", {}))
    changed = dataclasses.replace(
        changed, **{k: v for k, v in change.items() if k != "target_changes"}
    )
    result, _ = ensure_target(paths, changed, *write_corpus(paths, changed), log=lambda _l: None)
    assert not result.cached


def test_an_unfinished_save_is_not_taken_for_a_cached_target(tmp_path):
    paths = DemoPaths(tmp_path)
    preset = tiny_preset()
    rows = write_corpus(paths, preset)
    ensure_target(paths, preset, *rows, log=lambda _line: None)
    (paths.target / demo_target.FINGERPRINT_FILE).unlink()  # as if killed while saving
    result, _ = ensure_target(paths, preset, *rows, log=lambda _line: None)
    assert not result.cached


# ---------------------------------------------------------------------------- batching


def test_length_batches_cover_every_row_once_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, 500).tolist()
    batches = length_batches(lengths, 1024)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 1024


def test_collate_supervises_only_assistant_tokens_and_never_padding():
    a = (np.array([5, 6, 7, 8], np.int32), np.array([0, 0, 1, 1], np.uint8))
    b = (np.array([9, 10], np.int32), np.array([0, 1], np.uint8))
    ids, labels = collate([a, b], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    # labels[t] is the target of position t: token t + 1 where it is supervised.
    assert labels.tolist() == [[-100, 7, 8], [10, -100, -100]]


# ---------------------------------------------------------------------------- commands


def test_the_demo_train_command_is_a_valid_train_configuration(tmp_path):
    from dflash_train.train.command import add_arguments, config_from_args

    for preset in (demo.default_preset(), quick_preset()):
        argv = demo.train_argv(DemoPaths(tmp_path), preset)
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = config_from_args(parser.parse_args(argv[1:]))
        assert cfg.pipeline.target_devices == ["cpu", "cpu"]
        assert cfg.pipeline.drafter_devices == ["cpu", "cpu"]
        assert cfg.model.block_size == 16
        assert cfg.pipeline.hs_min_ready <= cfg.pipeline.hs_queue_depth


def test_the_real_model_commands_use_flags_the_commands_accept():
    from dflash_train.cli import COMMANDS

    text = "\n".join(demo.real_model_commands()).replace("\\\n", " ")
    for line in text.splitlines():
        if not line.startswith("dflash-train "):
            continue
        name, *args = line.split()[1:]
        module = __import__(COMMANDS[name][0], fromlist=["add_arguments"])
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        parser.parse_args(args)  # exits (SystemExit) on an unknown flag


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_paths_live_under_the_output_directory(tmp_path):
    paths = DemoPaths(tmp_path / "x")
    for p in (paths.train_data, paths.target, paths.run, paths.drafter, paths.report):
        assert Path(p).is_relative_to(tmp_path / "x")


def test_the_demo_writes_only_into_a_directory_it_may_take(tmp_path):
    """Regression: `demo --out DIR` replaced DIR/data/train.jsonl (and prepared/, run/...)
    in any directory, a user's own data included."""
    from dflash_train.demo import claim_demo_dir

    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "train.jsonl").write_text("my data\n")
    with pytest.raises(ValueError, match="not a demo's directory"):
        claim_demo_dir(mine)
    assert (mine / "data" / "train.jsonl").read_text() == "my data\n"
    claim_demo_dir(tmp_path / "new")  # new, then a rerun of it
    claim_demo_dir(tmp_path / "new")
    older = tmp_path / "older"  # a demo's, written before the marker
    for name in ("data", "tokenizer", "target", "run"):
        (older / name).mkdir(parents=True)
    claim_demo_dir(older)
    with pytest.raises(ValueError, match="is a file"):
        claim_demo_dir(mine / "data" / "train.jsonl")
