"""The feature store end to end, through the real commands: `capture` (resumable after a full
disk, refused when the disk cannot hold it), `train --features` (the online run's losses step
for step from an fp32 store, no target loaded, a store of other features refused in one line),
the reader stage of the fault matrix, and the hybrid `--cache-features` (resumed in either
phase, every row trained once)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_train import cli, faults
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.store.store import FeatureStore
from dflash_train.train.resume import resume_config
from pipeline_helpers import StopsAt, logged_losses, tiny_train_config, write_random_dataset
from pipeline_helpers import run_trainer as run

ROWS = 30
K = "3"  # target features: layers [1, 2, 3] of the 6-layer tiny target


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_target) -> Path:
    """Data, an fp32 store of it, another target (same config, other weights), other data."""
    root = tmp_path_factory.mktemp("store")
    write_random_dataset(root / "data", num_rows=ROWS)
    write_random_dataset(root / "other_data", num_rows=ROWS, seed=1)
    save_random_qwen3(root / "other_target", seed=1)
    (root / "target").symlink_to(tiny_target)
    assert cli.main(capture_argv(root, root / "fp32", "--dtype", "fp32")) == 0
    return root


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.install(None)


def capture_argv(ws: Path, out: Path, *extra: str, data: str = "data") -> list[str]:
    return [
        "capture", "--target", str(ws / "target"), "--data", str(ws / data), "--out", str(out),
        "--num-target-features", K, "--target-devices", "cpu", "--cpu-threads", "1",
        "--batch-size", "2", *extra,
    ]  # fmt: skip


def train_argv(ws: Path, out: Path, *extra: str, target: str = "target") -> list[str]:
    return [
        "train", "--target", str(ws / target), "--data", str(ws / "data"), "--out", str(out),
        "--drafter-devices", "cpu,cpu", "--draft-layers", "1", "--block-size", "8",
        "--num-target-features", K, "--num-anchors", "16", "--batch-size", "2",
        "--batch-cost", "blocks", "--epochs", "2", "--hs-queue-depth", "6", "--hs-min-ready", "3",
        "--num-prefetchers", "2", "--log-every", "1", "--save-every", "4", "--no-progress",
        "--cpu-threads", "1", "--stall-timeout", "30", "--mask-token-id", "255", *extra,
    ]  # fmt: skip


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


def deterministic(ws: Path, out: Path, **kw):
    """One prefetcher, one target worker or reader, one drafter, FIFO: a reproducible run."""
    return tiny_train_config(
        ws / "target", ws / "data", out, target_devices=["cpu"], drafter_devices=["cpu"],
        num_prefetchers=1, num_readers=1, mix="fifo", epochs=2, log_every=1, bucket_lengths=[128],
        num_target_features=int(K), **kw,
    )  # fmt: skip


# ---------------------------------------------------------------------- train --features
def test_an_fp32_store_trains_the_online_runs_losses_step_for_step_without_a_target(
    ws, tmp_path, monkeypatch
):
    _, online = run(deterministic(ws, tmp_path / "online"))
    assert online.complete and online.steps == 30

    def no_target(*_a, **_k):
        raise AssertionError("a target model was loaded")

    # Neither a target worker's model nor a whole model for the head: only safetensors reads.
    monkeypatch.setattr("dflash_train.model.target.load_causal_lm", no_target)
    monkeypatch.setattr("dflash_train.train.models.TargetFeatureExtractor", no_target)
    trainer, stored = run(deterministic(ws, tmp_path / "stored", features=str(ws / "fp32")))
    assert stored.complete and stored.steps == 30 and "all match" in stored.accounting
    assert trainer.extractors == [] and len(trainer.features.readers) == 1
    want, got = logged_losses(tmp_path / "online"), logged_losses(tmp_path / "stored")
    assert sorted(got) == list(range(1, 31))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step  # fp32 sums' order
    metrics = [
        json.loads(x) for x in (tmp_path / "stored" / "metrics.jsonl").read_text().splitlines()
    ]
    read = [m for m in metrics if "store/read_bytes_per_batch" in m]
    # 2 rows of (20..120 tokens) x 3 layers x 64 fp32 per batch.
    assert read and all(
        2 * 20 * 768 <= m["store/read_bytes_per_batch"] <= 2 * 120 * 768 for m in read
    )


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_16_and_8_bit_stores_train_through_the_cli(dtype, ws, tmp_path, capsys):
    store = tmp_path / dtype
    assert cli.main(capture_argv(ws, store, "--dtype", dtype)) == 0
    assert FeatureStore.open(store).binding.dtype == dtype
    code = cli.main(train_argv(ws, tmp_path / "run", "--features", str(store)))
    assert code == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]


def test_engine_flags_with_a_store_are_said_once_to_have_no_effect(ws, tmp_path, capsys):
    """Regression: --target-backend vllm (and its engine's flags) with --features, where the
    store replaces the target, were dropped without a word."""
    engine = ["--target-backend", "vllm", "--target-endpoint", "http://localhost:1"]
    argv = train_argv(ws, tmp_path / "run", "--features", str(ws / "fp32"), *engine)
    code = cli.main([*argv, "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    notes = [line for line in err.splitlines() if "no effect with --features" in line]
    assert notes == [
        "note: --target-backend vllm, --target-endpoint have no effect with --features (no "
        "target runs)"
    ], err


def damaged(ws: Path, tmp_path: Path, how: str) -> Path:
    store = shutil.copytree(ws / "fp32", tmp_path / "damaged")
    if how == "truncated":
        values = store / "shard-00000.bin"
        values.write_bytes(values.read_bytes()[:-10])
    elif how == "no index":
        (store / "shard-00000.idx").unlink()
    elif how == "no manifest":
        (store / "manifest.json").unlink()
    elif how == "incomplete":
        idx = store / "shard-00000.idx"
        idx.write_bytes(idx.read_bytes()[:-24])  # the last row's record
    return store


BAD_STORES = {
    "other target": ({"target": "other_target"}, "captured from another target"),
    "other data": ({"store": "other_data"}, "captured from other data"),
    "other layers": ({"extra": ("--target-layer-ids", "1,4")}, "holds target layers [1, 2, 3]"),
    "truncated": ({"damage": "truncated"}, "shard-00000.bin is truncated"),
    "no index": ({"damage": "no index"}, "index shard-00000.idx of shard shard-00000 is missing"),
    "no manifest": ({"damage": "no manifest"}, "not a feature store: it has no manifest.json"),
    "incomplete": ({"damage": "incomplete"}, "holds 29 of 30 rows: its capture did not finish"),
    "eval": ({"extra": ("--eval-every", "5")}, "evaluate afterwards with `dflash-train eval`"),
}


@pytest.mark.parametrize("case", list(BAD_STORES))
def test_a_store_that_does_not_fit_the_run_is_one_line_and_nothing_is_written(
    case, ws, tmp_path, capsys
):
    spec, said = BAD_STORES[case]
    store = ws / "fp32"
    if "damage" in spec:
        store = damaged(ws, tmp_path, spec["damage"])
    if "store" in spec:
        store = tmp_path / "other_store"
        assert cli.main(capture_argv(ws, store, "--dtype", "fp32", data=spec["store"])) == 0
        capsys.readouterr()
    out = tmp_path / "run"
    argv = train_argv(ws, out, "--features", str(store), *spec.get("extra", ()),
                      target=spec.get("target", "target"))  # fmt: skip
    code = cli.main(argv)
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and said in lines[0], lines
    assert not out.exists()


# ---------------------------------------------------------------------- capture
def test_a_capture_stopped_by_a_full_disk_resumes_and_stores_every_row_once(ws, tmp_path, capsys):
    out = tmp_path / "store"
    faults.install([{"stage": "store_write", "at": 13, "action": "disk_full"}])
    code = cli.main(capture_argv(ws, out, "--dtype", "fp32"))
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and "no space left on the device" in lines[0], lines
    assert "run the same command again to continue" in lines[0]
    partial = FeatureStore.open(out).present()
    assert 0 < partial.sum() < 13  # whole committed steps only: the failed one is not there
    faults.install(None)
    assert cli.main(capture_argv(ws, out, "--dtype", "fp32")) == 0
    err = capsys.readouterr().err
    assert f"capture accounting: {ROWS} rows read" in err and "all match" in err
    assert f"{partial.sum()} stored already" in err
    store, fresh = FeatureStore.open(out), FeatureStore.open(ws / "fp32")
    assert store.present().all() and len(store.manifest.shards) == 2
    rows = np.concatenate(
        [
            np.fromfile(out / f"{s}.idx", dtype=np.int64).reshape(-1, 3)[:, 0]
            for s in store.manifest.shards
        ]
    )
    assert sorted(rows.tolist()) == list(range(ROWS))  # each row exactly once
    for r in range(ROWS):
        a = np.array(store.row_bytes(r)).view(np.float32)
        b = np.array(fresh.row_bytes(r)).view(np.float32)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_a_dry_run_prints_the_estimate_and_writes_nothing(ws, tmp_path, capsys):
    out = tmp_path / "store"
    assert cli.main(capture_argv(ws, out, "--dtype", "fp8", "--dry-run")) == 0
    captured = capsys.readouterr()
    assert "3 layers x 64 hidden in fp8 + 3 fp32 scales = 204 bytes per token" in captured.err
    summary = json.loads(captured.out)
    tokens = int(np.diff(np.load(ws / "data" / "offsets.npy")).sum())
    assert summary["bytes"] == tokens * 204 + ROWS * 24
    assert not out.exists()


def test_a_capture_the_disk_cannot_hold_is_refused_before_anything_is_written(
    ws, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("dflash_train.store.store.free_bytes", lambda _p: 1000)
    out = tmp_path / "store"
    code = cli.main(capture_argv(ws, out))
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and "free: free some space" in lines[0], lines
    assert not out.exists()


def test_a_capture_into_a_store_of_other_features_is_refused_unless_overwrite(ws, tmp_path, capsys):
    out = shutil.copytree(ws / "fp32", tmp_path / "store")
    code = cli.main(capture_argv(ws, out, "--dtype", "bf16"))
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and "holds fp32, not bf16" in lines[0] and "--overwrite" in lines[0]
    assert FeatureStore.open(out).binding.dtype == "fp32"
    assert cli.main(capture_argv(ws, out, "--dtype", "bf16", "--overwrite")) == 0
    assert FeatureStore.open(out).binding.dtype == "bf16"


def test_a_vllm_capture_whose_engine_cannot_start_is_one_line(ws, tmp_path, capsys):
    # The capture's engine comes up as train's does (tests/integration/test_vllm_backend.py
    # captures with one); an interpreter that does not exist is refused before any row is read.
    argv = capture_argv(ws, tmp_path / "s", "--target-backend", "vllm")
    code = cli.main([*argv, "--vllm-python", str(tmp_path / "no-such-python")])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and "no-such-python" in lines[0], lines
    assert not FeatureStore.open(tmp_path / "s").present().any()


# ---------------------------------------------------------------------- the reader stage
def test_a_reader_that_raises_stops_the_run_and_resume_trains_every_row_once(ws, tmp_path, capsys):
    out = tmp_path / "run"
    faults.install([{"stage": "reader", "at": 5, "action": "raise"}])
    code = cli.main(train_argv(ws, out, "--features", str(ws / "fp32")))
    err = capsys.readouterr().err
    assert code == 1 and "worker 'reader-" in err and "injected fault in reader" in err, err
    faults.install(None)
    assert cli.main(["train", "--resume", str(out)]) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]
    assert all(e["trained"] == ROWS for e in res["accounting"]["per_epoch"])


@pytest.mark.slow
@pytest.mark.parametrize(("action", "code"), [("hang", 124), ("sleep", 0)])
def test_a_hung_reader_is_declared_hung_and_a_slow_one_is_not_killed(
    action, code, ws, tmp_path, capsys
):
    seconds = 4.0 if action == "hang" else 1.0  # longer / shorter than the stall timeout
    faults.install(
        [
            {
                "stage": "reader",
                "at": 3,
                "action": action,
                "seconds": seconds,
                "every": action == "hang",
            }
        ]
    )  # every reader call: the stage as a whole
    argv = train_argv(ws, tmp_path / "run", "--features", str(ws / "fp32"))
    argv[argv.index("--stall-timeout") + 1] = "1.5"
    got = cli.main([*argv, "--stop-timeout", "10"])
    err = capsys.readouterr().err
    assert got == code, err[-2000:]
    if action == "hang":
        assert "no pipeline progress" in err and "thread stacks:" in err


# ---------------------------------------------------------------------- the hybrid
def test_the_hybrid_trains_the_online_losses_and_computes_each_row_once(ws, tmp_path):
    run(deterministic(ws, tmp_path / "online"))
    cache = tmp_path / "cache"
    trainer, hybrid = run(
        deterministic(ws, tmp_path / "hybrid", cache_features=str(cache), cache_dtype="fp32")
    )
    assert hybrid.complete and "all match" in hybrid.accounting
    want, got = logged_losses(tmp_path / "online"), logged_losses(tmp_path / "hybrid")
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    # The first epoch computed every row once and stored it; the second read them all.
    assert trainer.features.readers[0].rows_computed == ROWS
    assert FeatureStore.open(cache).present().all()


def test_the_hybrid_resumes_in_either_phase_and_a_budget_keeps_the_chosen_rows(ws, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    budget = "40000"  # bytes: a part of the 30 rows (~1.8 MB in fp32)
    cfg = deterministic(ws, out, cache_features=str(cache), cache_dtype="fp32", cache_budget=budget)
    _, first = run(cfg, StopsAt, stop_at=7)  # in the first epoch (15 steps each)
    assert first.interrupted == "SIGTERM"
    stored_early = FeatureStore.open(cache).present().sum()
    cfg2, resume = resume_config(out, {})
    _, second = run(cfg2, StopsAt, resume=resume, stop_at=21)  # in the second epoch
    assert second.interrupted == "SIGTERM"
    cfg3, resume = resume_config(out, {})
    trainer, third = run(cfg3, resume=resume)
    assert third.complete and [e["trained"] for e in third.per_epoch] == [ROWS, ROWS]
    assert all(e["trained_exactly_once"] for e in third.per_epoch)
    store = FeatureStore.open(cache)
    chosen = trainer.features.readers[0].admit
    assert 0 < chosen.sum() < ROWS and stored_early <= chosen.sum()
    assert np.array_equal(store.present(), chosen)  # exactly the rows the budget chose
    assert store.stored_bytes() <= 40000


def test_a_hybrid_cache_of_other_features_is_refused_in_one_line(ws, tmp_path, capsys):
    code = cli.main(train_argv(ws, tmp_path / "run", "--cache-features", str(ws / "fp32"),
                               "--cache-dtype", "fp8"))  # fmt: skip
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and "holds fp32, not fp8" in lines[0], lines
    assert not (tmp_path / "run").exists()
