"""Failure is a tested contract: every stage x every fault, through the real `train` command.

Stages: prefetch, target, drafter_forward, drafter_backward, rendezvous, eval, checkpoint_write
(the pipeline's), metrics_backend and telemetry (the main thread's). Outcomes (the README's
failure table):
- raise in a pipeline stage: exit 1 within 30 s, the worker named with its traceback, the
  weights trained so far saved; `--resume` then finishes with every sequence trained once;
- hang (longer than --stall-timeout): exit 124 from the watchdog with every thread's stack in
  the log (or exit 1 from the lockstep's own timeout naming the missing replica); a main thread
  stuck in a metric backend or telemetry is ended by the watchdog, which saves first;
- slow (shorter than --stall-timeout): never killed, the run finishes;
- a metric backend or telemetry that raises: said once, training goes on, metrics.jsonl complete;
- the final checkpoint's write slower than --stop-timeout: waited for (said), the run finishes;
- a corrupt checkpoint of the right size: `--resume` falls back to the one before, said once;
- the target on an engine (`--target-backend vllm`, here the real engine server and connector
  around a fake of vLLM's engine core, `fake_vllm_core`): an engine core that steps only while
  it has requests (vLLM in-process) serves every batch, and an engine serving another target is
  refused at start in one line, exit 2 (the vLLM-backed cases: test_vllm_backend_faults.py).
After every run: no pipeline thread alive, no half-written file, every opened sink closed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_train import cli, faults
from dflash_train.model.draft import default_target_layer_ids
from dflash_train.store import shards
from dflash_train.store.lock import LOCK_FILE
from dflash_train.store.store import FeatureStore
from dflash_train.train import checkpoint, command
from engine_helpers import FakeServer
from fake_vllm_core import InProcessEngine, connector_module, make_core
from pipeline_helpers import chat_workspace, fine_tune

PIPELINE_THREADS = ("prefetch-", "target-", "drafter-", "watchdog", "checkpoint-writer")
WORKER = {
    "prefetch": "prefetch-",
    "target": "target-",
    "drafter_forward": "drafter-",
    "drafter_backward": "drafter-",
    "rendezvous": "drafter-",
    "eval": "drafter-0",
    "checkpoint_write": "drafter-0",
}
CONTEXT = {"eval": "in-loop evaluation failed", "checkpoint_write": "writing a checkpoint failed"}
AT = {"rendezvous": 5, "eval": 1, "checkpoint_write": 1}  # default: the 3rd call
STALL_S = 1.5
HANG_S = 4.0  # longer than the stall timeout; the hung thread then wakes and exits by itself
SLOW_S = 1.0  # shorter than the stall timeout: slow but alive, never killed


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    chat_workspace(
        root, conversations=40, prompts=6, seed=5, initializer_range=0.1, prepare_max_length=200
    )
    return root


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.install(None)


def train_argv(ws: Path, out: Path, *extra: str, eval_on: bool = False) -> list[str]:
    argv = [
        "train", "--target", str(ws / "target"), "--data", str(ws / "data"), "--out", str(out),
        "--target-devices", "cpu,cpu", "--drafter-devices", "cpu,cpu", "--draft-layers", "1",
        "--block-size", "8", "--num-target-features", "2", "--num-anchors", "16",
        "--batch-size", "2", "--epochs", "2", "--hs-queue-depth", "6", "--hs-min-ready", "3",
        "--num-prefetchers", "2", "--log-every", "1", "--save-every", "3", "--no-progress",
        "--cpu-threads", "1", "--stall-timeout", str(STALL_S), "--stop-timeout", "10",
        "--bucket-lengths", "96,200", "--batch-cost", "blocks",
    ]  # fmt: skip
    # --batch-cost blocks: the cost probe (--batch-cost auto, tested apart) is not the stages
    # under test, and on a loaded machine it alone outlasted the bounds below.
    if eval_on:
        argv += ["--eval-every", "4", "--eval-prompts", str(ws / "prompts.jsonl")]
        argv += ["--eval-num-prompts", "1", "--eval-max-new-tokens", "6"]
    return [*argv, *extra]


class SinkSpy:
    """Counts the metric sinks the train command opens and closes."""

    def __init__(self, monkeypatch) -> None:
        self.opened, self.closed = 0, 0
        real = command.build_loggers

        def spying(*args, **kwargs):
            logger = real(*args, **kwargs)
            self.opened += 1
            close = logger.close

            def counted_close():
                self.closed += 1
                close()

            logger.close = counted_close
            return logger

        monkeypatch.setattr(command, "build_loggers", spying)


def run_train(argv, capsys, monkeypatch) -> tuple[int, str, float, SinkSpy]:
    spy = SinkSpy(monkeypatch)
    t0 = time.monotonic()
    code = cli.main(argv)
    return code, capsys.readouterr().err, time.monotonic() - t0, spy


def assert_clean(run_dir: Path, spy: SinkSpy, allowed: tuple[str, ...] = ()) -> None:
    """Resource hygiene after any ending: threads, half-written files (but those `allowed`,
    and what is under them), sinks."""
    deadline = time.monotonic() + HANG_S + 10
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith(PIPELINE_THREADS)]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, f"pipeline threads still alive: {alive}"
    assert spy.opened == spy.closed == 1
    half = [
        p
        for p in run_dir.rglob("*")
        if (p.name.endswith(".tmp") or p.name.startswith("."))
        and not any(part in allowed for part in p.relative_to(run_dir).parts)
    ]
    assert half == [], f"half-written files left: {half}"


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sorted({json.loads(x)["step"] for x in lines if "train/loss" in json.loads(x)})


def resume_finishes_exactly_once(run_dir: Path, capsys, monkeypatch) -> None:
    code, err, _, spy = run_train(["train", "--resume", str(run_dir)], capsys, monkeypatch)
    assert code == 0, err
    res = result(run_dir)
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]
    assert all(e["trained"] == e["sequences"] for e in res["accounting"]["per_epoch"])
    assert_clean(run_dir, spy)


PIPELINE_STAGES = list(WORKER)


@pytest.mark.parametrize("stage", PIPELINE_STAGES)
def test_a_stage_that_raises_stops_the_run_saves_and_resumes(
    stage, workspace, tmp_path, capsys, monkeypatch
):
    faults.install([{"stage": stage, "at": AT.get(stage, 3), "action": "raise"}])
    out = tmp_path / "run"
    code, err, seconds, spy = run_train(
        train_argv(workspace, out, eval_on=stage == "eval"), capsys, monkeypatch
    )
    assert code == 1 and seconds < 30, err
    assert f"worker '{WORKER[stage]}" in err and "Traceback" in err
    assert f"injected fault in {stage}" in err and CONTEXT.get(stage, "") in err
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "interrupted or failed"  # the weights trained so far are kept
    assert_clean(out, spy)
    faults.install(None)
    resume_finishes_exactly_once(out, capsys, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("stage", PIPELINE_STAGES)
def test_a_stage_that_hangs_is_declared_hung_with_every_stack_logged(
    stage, workspace, tmp_path, capsys, monkeypatch
):
    fault = {"stage": stage, "at": AT.get(stage, 3), "action": "hang", "seconds": HANG_S}
    # Two prefetchers and two target workers: with one of them hung the other carries the run
    # on, and on a loaded machine past the hang's end. Every later call hangs too, so the stage
    # as a whole is stuck, whatever the machine's speed.
    fault["every"] = stage in ("prefetch", "target")
    faults.install([fault])
    out = tmp_path / "run"
    code, err, seconds, spy = run_train(
        train_argv(workspace, out, eval_on=stage == "eval"), capsys, monkeypatch
    )
    watchdog = "no pipeline progress" in err and code == 124
    rendezvous = "did not reach step" in err and code == 1  # the lockstep's own timeout
    assert watchdog or rendezvous, (code, err[-2000:])
    assert seconds < STALL_S + HANG_S + 15
    if watchdog:
        assert "thread stacks:" in err and "--- thread " in err
    assert_clean(out, spy)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [*PIPELINE_STAGES, "metrics_backend", "telemetry"])
def test_a_slow_but_alive_stage_is_not_killed(stage, workspace, tmp_path, capsys, monkeypatch):
    faults.install([{"stage": stage, "at": AT.get(stage, 3), "action": "sleep", "seconds": SLOW_S}])
    out = tmp_path / "run"
    extra = ("--tensorboard",) if stage == "metrics_backend" else ()
    code, err, _, spy = run_train(
        train_argv(workspace, out, *extra, eval_on=stage == "eval"), capsys, monkeypatch
    )
    assert code == 0, err[-2000:]
    assert result(out)["complete"]
    assert_clean(out, spy)


def test_a_final_save_slower_than_the_stop_timeout_is_waited_for_and_said(
    workspace, tmp_path, capsys, monkeypatch
):
    """Regression (issue 33, item 8): the final save waited at most --stop-timeout, so slow
    storage failed a finished run and lost or marked incomplete its only checkpoint. That bound
    is a stop signal's; a run that finished waits while the write progresses, saying so."""
    monkeypatch.setattr(checkpoint, "PROGRESS_EVERY_S", 0.5, raising=False)
    faults.install([{"stage": "checkpoint_write", "at": 1, "action": "sleep", "seconds": 3.0}])
    out = tmp_path / "run"
    extra = ("--save-every", "0", "--stop-timeout", "1", "--stall-timeout", "30")
    code, err, _, spy = run_train(train_argv(workspace, out, *extra), capsys, monkeypatch)
    assert code == 0, err[-2000:]
    assert "still writing" in err
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "finished" and state["complete"]
    assert result(out)["complete"]
    assert_clean(out, spy)


def test_a_corrupt_checkpoint_of_the_right_size_falls_back_to_the_one_before(
    workspace, tmp_path, capsys, monkeypatch
):
    """Regression (issue 33, item 10): sizes were the only check, so a corrupt newest
    checkpoint of the right size was resumed from."""
    out = tmp_path / "run"
    code, err, _, _ = run_train(train_argv(workspace, out), capsys, monkeypatch)
    assert code == 0, err[-2000:]
    *_, before, newest = sorted((out / "checkpoints").iterdir())
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # tensor bytes, past the header
    weights.write_bytes(bytes(data))
    code, err, _, spy = run_train(["train", "--resume", str(out)], capsys, monkeypatch)
    assert code == 0, err[-2000:]
    said = [line for line in err.splitlines() if "cannot be read" in line]
    assert len(said) == 1 and f"{weights} is corrupt" in said[0] and before.name in said[0]
    res = result(out)
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]
    assert res["resumed_from_steps"] == [int(before.name.split("_")[1])]
    assert (out / "checkpoints" / f".{newest.name}.corrupt").is_dir()  # set aside, for a look
    assert_clean(out, spy, allowed=(f".{newest.name}.corrupt",))


@pytest.mark.parametrize(
    ("stage", "said"),
    [("metrics_backend", "the TensorBoard backend failed"), ("telemetry", "GPU telemetry failed")],
)
def test_a_failing_metric_backend_or_telemetry_is_said_once_and_training_goes_on(
    stage, said, workspace, tmp_path, capsys, monkeypatch
):
    faults.install([{"stage": stage, "at": 2, "action": "raise"}])
    out = tmp_path / "run"
    code, err, _, spy = run_train(train_argv(workspace, out, "--tensorboard"), capsys, monkeypatch)
    assert code == 0, err[-2000:]
    assert err.count(said) == 1
    res = result(out)
    assert res["complete"] and steps_logged(out) == list(range(1, res["steps"] + 1))
    assert_clean(out, spy)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["metrics_backend", "telemetry"])
def test_a_stuck_main_thread_is_ended_by_the_watchdog_after_saving(stage, workspace, tmp_path):
    # The main thread itself hangs (in a metric backend, or a telemetry read): only the
    # watchdog's last resort can end the run; it saves first (the drafters have stopped).
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "dflash_train", *train_argv(workspace, out, "--tensorboard")]
    argv[argv.index("--stop-timeout") + 1] = "3"
    env = dict(os.environ, DFLASH_FAULTS=json.dumps([{"stage": stage, "at": 3, "action": "hang"}]))
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 124, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert "thread stacks:" in proc.stderr and "the main thread did not react" in proc.stderr
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "interrupted or failed"
    resumed = subprocess.run([sys.executable, "-m", "dflash_train", "train", "--resume", str(out)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert result(out)["accounting"]["finished_epochs_trained_exactly_once"]


# ---------------------------------------------------------------------- the feature cache
def test_a_second_writer_of_a_feature_cache_is_refused_naming_the_first(
    workspace, tmp_path, capsys, monkeypatch
):
    cache = tmp_path / "cache"
    first = [sys.executable, "-m", "dflash_train", *train_argv(workspace, tmp_path / "first",
             "--cache-features", str(cache), "--stall-timeout", "60")]  # fmt: skip
    slow = {"stage": "drafter_step", "action": "sleep", "seconds": 0.3, "every": True}
    env = dict(os.environ, DFLASH_FAULTS=json.dumps([slow]))
    proc = subprocess.Popen(first, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # The first holds the cache and has trained (so committed rows to its live shard).
        lock, metrics = cache / LOCK_FILE, tmp_path / "first" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and "train/loss" in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the first never trained"
            time.sleep(0.1)
        assert f'"pid": {proc.pid}' in lock.read_text()
        out = tmp_path / "second"
        code, err, _, _ = run_train(
            train_argv(workspace, out, "--cache-features", str(cache)), capsys, monkeypatch
        )
        lines = [x for x in err.splitlines() if "error:" in x]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert f"is being written by another process (host {socket.gethostname()}, pid " in err
        assert f"pid {proc.pid})" in lines[0] and not out.exists()
        proc.send_signal(signal.SIGTERM)  # the first stops as a scheduler would stop it
        assert proc.wait(timeout=120) == 143, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    stored = FeatureStore.open(cache)  # the first's store is whole: opens, every record checked
    assert stored.present().any()


def test_a_full_disk_in_the_middle_of_a_cache_row_stops_the_run_and_resume_finishes(
    workspace, tmp_path, capsys, monkeypatch
):
    # Rows are written in 4 KiB pieces here, so the disk fills in the middle of a row, while
    # the other target worker goes on appending to the same shard until the run stops.
    monkeypatch.setattr(shards, "WRITE_CHUNK", 4096)
    faults.install([{"stage": "store_write", "at": 60, "action": "disk_full"}])
    cache, out = tmp_path / "cache", tmp_path / "run"
    argv = train_argv(workspace, out, "--cache-features", str(cache), "--cache-dtype", "fp32")
    code, err, _, spy = run_train(argv, capsys, monkeypatch)
    lines = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(lines) == 1 and "no space left on the device" in lines[0], err
    assert_clean(out, spy)
    faults.install(None)
    resume_finishes_exactly_once(out, capsys, monkeypatch)
    # Every stored row is whole: as the target computes it (a capture of the same rows).
    ref = tmp_path / "captured"
    capture = ["capture", "--target", str(workspace / "target"), "--data",
               str(workspace / "data"), "--out", str(ref), "--num-target-features", "2",
               "--target-devices", "cpu", "--cpu-threads", "1", "--dtype", "fp32"]  # fmt: skip
    assert cli.main(capture) == 0
    store, want = FeatureStore.open(cache), FeatureStore.open(ref)
    assert store.present().all()
    for r in range(len(store.present())):
        got, exp = (np.array(s.row_bytes(r)).view(np.float32) for s in (store, want))
        np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-5)


def engine_shape(ws: Path) -> tuple[list[int], int]:
    """The DFlash layer ids this matrix's runs read (--num-target-features 2) and the hidden size
    of its target: what an engine serving them reports."""
    config = json.loads((ws / "target" / "config.json").read_text())
    return default_target_layer_ids(config["num_hidden_layers"], 2), config["hidden_size"]


ENGINE_MODEL_LEN = 256  # the longest bucket (200) + 16, and then some


def test_an_engine_core_that_steps_only_while_it_has_requests_serves_every_batch(
    workspace, tmp_path, capsys, monkeypatch
):
    # vLLM's engine core in the server's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) steps only
    # while a request is unfinished: a hand-over that waited for a later step never came, and
    # every batch failed at its deadline (504). The real server, connector and client here.
    served, hidden = engine_shape(workspace)
    with connector_module() as mod:

        def engine(directory: Path) -> InProcessEngine:
            core = make_core(mod, directory, len(served), hidden, num_blocks=1024, budget=96)
            return InProcessEngine(core)

        server = FakeServer(
            tmp_path / "engine", workspace / "target", served, hidden, bound=1 << 30,
            max_model_len=ENGINE_MODEL_LEN, engine=engine,
        )  # fmt: skip
        out = tmp_path / "run"
        argv = train_argv(workspace, out, "--target-backend", "vllm")
        try:
            code, err, _, spy = run_train(
                [*argv, "--target-endpoint", server.url], capsys, monkeypatch
            )
        finally:
            server.close()
    assert code == 0, err[-2000:]
    res = result(out)
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]
    assert server.engine.core.steps > 0 and server.files() == []
    assert_clean(out, spy)


def test_an_endpoint_serving_another_target_is_refused_in_one_line(workspace, tmp_path, capsys):
    # Another fine-tune of the same shape: every check of shape passes, the features are not
    # this target's; a store or run would be stamped with the wrong weights.
    served, hidden = engine_shape(workspace)
    other = tmp_path / "other"
    fine_tune(workspace / "target", other, "mlp", "end")
    server = FakeServer(tmp_path / "engine", other, served, hidden, max_model_len=ENGINE_MODEL_LEN)
    out = tmp_path / "run"
    try:
        argv = train_argv(workspace, out, "--target-backend", "vllm")
        code = cli.main([*argv, "--target-endpoint", server.url])
    finally:
        server.close()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert f"the engine at {server.url} serves other weights than this run's --target" in lines[0]
    assert not out.exists() and server.engine.prompts == []


def test_the_fault_plan_is_off_and_free_by_default():
    faults.install(None)
    assert faults._plan == []
    t0 = time.perf_counter()
    for _ in range(100_000):
        faults.point("drafter_step")
    assert time.perf_counter() - t0 < 0.5  # a list check per call, nothing more
    with pytest.raises(ValueError, match="bad fault"):
        faults.install([{"stage": "nowhere"}])
    assert signal.SIGTERM  # (the module imports what the subprocess test needs)
