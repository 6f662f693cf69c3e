"""The losses on the target's distribution end to end: each trains through the CLI (DFlash 1
and 2); its teacher's input travels through a feature store (captured with --teacher-input,
read by --features and by the hybrid) to the online run's losses step for step; what cannot
give the teacher is refused in one line; a change of loss on --resume is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train import cli
from dflash_train.model.target import TEACHER_INPUT_ID
from dflash_train.store.store import FeatureStore
from pipeline_helpers import logged_losses, tiny_train_config, write_random_dataset
from pipeline_helpers import run_trainer as run

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = 16
K = 3  # target features: layers [1, 2, 3] of the 6-layer, hidden-64 tiny target


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_target) -> Path:
    """Data and an fp32 store of it with the teacher's input."""
    root = tmp_path_factory.mktemp("losses")
    write_random_dataset(root / "data", num_rows=ROWS)
    (root / "target").symlink_to(tiny_target)
    torch.set_num_threads(1)
    assert cli.main(capture_argv(root, root / "teacher", "--dtype", "fp32", "--teacher-input")) == 0
    return root


def capture_argv(ws: Path, out: Path, *extra: str) -> list[str]:
    return [
        "capture", "--target", str(ws / "target"), "--data", str(ws / "data"), "--out", str(out),
        "--num-target-features", str(K), "--target-devices", "cpu", "--cpu-threads", "1",
        "--batch-size", "4", *extra,
    ]  # fmt: skip


def train_argv(ws: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--target", str(ws / "target"), "--data", str(ws / "data"), "--out", str(out),
        "--target-devices", "cpu", "--drafter-devices", "cpu", "--draft-layers", "1",
        "--block-size", "8", "--num-target-features", str(K), "--num-anchors", "16",
        "--batch-size", "2", "--batch-cost", "blocks", "--epochs", "1", "--hs-queue-depth", "4",
        "--hs-min-ready", "2", "--num-prefetchers", "1", "--log-every", "1", "--no-progress",
        "--cpu-threads", "1", "--stall-timeout", "60", "--mask-token-id", "255", *extra,
    ]  # fmt: skip


def deterministic(ws: Path, out: Path, **kw):
    """One prefetcher, one target worker or reader, one drafter, FIFO: a reproducible run."""
    return tiny_train_config(
        ws / "target", ws / "data", out, target_devices=["cpu"], drafter_devices=["cpu"],
        num_prefetchers=1, num_readers=1, mix="fifo", epochs=1, log_every=1, bucket_lengths=[128],
        num_target_features=K, **kw,
    )  # fmt: skip


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


@pytest.mark.parametrize(
    ("loss", "arch"), [("kl", "dflash"), ("lk_alpha", "dflash"), ("lk_lambda", "dflash2")]
)
def test_each_loss_trains_through_the_cli_and_says_what_it_trains(ws, tmp_path, capsys, loss, arch):
    extra = ["--loss", loss, "--arch", arch]
    if arch == "dflash2":
        extra += ["--selector-rank", "16", "--selector-top-k", "8"]
    out = tmp_path / "run"
    assert cli.main(train_argv(ws, out, *extra, "--max-steps", "4")) == 0
    err = capsys.readouterr().err
    assert f"objective: loss {loss}" in err and "on the target's distribution" in err, err
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 4 and all(0 <= x < 1e3 for x in losses), losses
    saved = json.loads((out / "config.json").read_text())
    assert saved["objective"]["loss"] == loss and saved["objective"]["lk_eta"] == 3.0


def test_the_teacher_travels_through_the_store_to_the_online_runs_losses(ws, tmp_path):
    store = FeatureStore.open(ws / "teacher")
    assert store.binding.layer_ids == (1, 2, 3, TEACHER_INPUT_ID)
    assert store.bytes_per_token == (K + 1) * 64 * 4  # fp32: one more hidden-size slot
    kw = {"loss": "lk_lambda", "position_weights": "dpace"}
    _, online = run(deterministic(ws, tmp_path / "online", **kw))
    assert online.complete and online.steps == ROWS // 2
    _, stored = run(deterministic(ws, tmp_path / "stored", features=str(ws / "teacher"), **kw))
    cache = tmp_path / "cache"
    hybrid_cfg = deterministic(
        ws, tmp_path / "hybrid", cache_features=str(cache), cache_dtype="fp32", **kw
    )
    _, hybrid = run(hybrid_cfg)
    assert stored.complete and hybrid.complete and "all match" in hybrid.accounting
    assert FeatureStore.open(cache).binding.layer_ids[-1] == TEACHER_INPUT_ID
    want = logged_losses(tmp_path / "online")
    for name in ("stored", "hybrid"):
        got = logged_losses(tmp_path / name)
        assert sorted(got) == sorted(want)
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)
    # The same store trains a ce run too: the reader picks the drafter's layers.
    _, ce = run(deterministic(ws, tmp_path / "ce", features=str(ws / "teacher"), max_steps=2))
    assert ce.steps == 2


def test_a_store_without_the_teacher_input_is_refused_in_one_line(ws, tmp_path, capsys):
    store = tmp_path / "plain"
    assert cli.main(capture_argv(ws, store, "--dtype", "bf16")) == 0
    assert TEACHER_INPUT_ID not in FeatureStore.open(store).binding.layer_ids
    capsys.readouterr()
    out = tmp_path / "run"
    code = cli.main(train_argv(ws, out, "--features", str(store), "--loss", "kl"))
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert "holds no teacher input" in lines[0] and "--teacher-input" in lines[0], lines
    assert lines[0].endswith("train with --loss ce") and not out.exists()
    # Every way out is named, and only those: on-policy with its default ce needs only the
    # rejected stream dropped; with kl too, --loss ce alone would still read the teacher.
    for extra, way_out in (
        ((), "train with --opd-rejected-weight 0"),
        (("--loss", "kl"), "train with --loss ce --opd-rejected-weight 0"),
    ):
        argv = train_argv(ws, out, "--features", str(store), "--anchors", "on-policy", *extra)
        code = cli.main(argv)
        lines = error_lines(capsys.readouterr().err)
        assert code == 2 and len(lines) == 1 and lines[0].endswith(way_out), lines
        assert not out.exists()


def test_the_teacher_needs_the_in_process_target_refused_in_one_line(ws, tmp_path, capsys):
    out, cache = tmp_path / "run", tmp_path / "cache"
    for extra in ((), ("--cache-features", str(cache))):
        code = cli.main(train_argv(ws, out, "--loss", "kl", "--target-backend", "vllm", *extra))
        lines = error_lines(capsys.readouterr().err)
        assert code == 2 and len(lines) == 1 and "not returned by the vLLM" in lines[0], lines
        assert "needed by --loss kl" in lines[0] and lines[0].endswith("train with --loss ce")
        assert not out.exists() and not cache.exists()
    store = tmp_path / "store"
    code = cli.main(capture_argv(ws, store, "--teacher-input", "--target-backend", "vllm"))
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and "needed by --teacher-input" in lines[0], lines
    assert lines[0].endswith("captured with --teacher-input"), lines
    assert not store.exists()


def test_resume_refuses_a_change_of_loss(ws, tmp_path, capsys):
    out = tmp_path / "run"
    _, res = run(deterministic(ws, out, max_steps=2))
    assert res.steps == 2
    capsys.readouterr()
    code = cli.main(["train", "--resume", str(out), "--loss", "lk_lambda", "--lk-eta", "2"])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert "loss: 'ce' -> 'lk_lambda'; lk_eta: 3.0 -> 2.0" in lines[0], lines
