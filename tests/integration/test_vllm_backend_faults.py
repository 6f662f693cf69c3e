"""The vLLM backend's failures as a contract (slow): the trainer starts its own engine in every
case here, since each case ends, hangs or slows that engine (the fault plan travels to it in
DFLASH_FAULTS, stage "engine": the engine process as it admits a batch).

- raise: the engine dies at its 3rd batch; the run stops with the target worker's error and the
  engine's last log lines (exit 1), keeps the weights trained so far, and `--resume` (a new
  engine) trains every sequence exactly once;
- hang: the engine stops answering; the run fails within the stall timeout (the request's own
  deadline, exit 1, or the watchdog, exit 124), and either report quotes the engine's log;
- slow: the engine sleeps at a batch; the run finishes (with vLLM's core in the server's process,
  VLLM_ENABLE_V1_MULTIPROCESSING=0, which steps only while a request is unfinished: every
  batch's features must come without a later step);
- start-up: a model vLLM refuses, or no memory for its cache: one line, exit 2;
and after every run, however it ended (success, a worker error, SIGTERM), not one process of
any engine it started is alive (checked by pid) and none of vLLM's /dev/shm segments is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_train import cli
from engine_helpers import (
    ENGINE_TEST_TIMEOUT_S,
    assert_no_engine_left,
    engine_pgids,
    save_vllm_target,
    shared_memory_segments,
    vllm_python,
)
from pipeline_helpers import write_random_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

STALL_S = 8.0  # the feature requests' deadline is 0.8 of it
ROWS = 24


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm_faults")
    save_vllm_target(root / "target")
    write_random_dataset(root / "data", num_rows=ROWS, max_len=100)
    return root


@pytest.fixture(autouse=True)
def no_shared_memory_left():
    """However the engine ended, none of vLLM's /dev/shm segments outlives it."""
    before = shared_memory_segments()
    yield
    assert shared_memory_segments() - before == set()


def train_argv(ws: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--target", str(ws / "target"), "--data", str(ws / "data"), "--out", str(out),
        "--target-backend", "vllm", "--vllm-python", vllm_python(),
        "--target-devices", "cpu,cpu", "--drafter-devices", "cpu", "--draft-layers", "1",
        "--block-size", "8", "--target-layer-ids", "1,3", "--mask-token-id", "255",
        "--num-anchors", "16", "--batch-size", "2", "--batch-cost", "blocks", "--epochs", "2",
        "--hs-queue-depth", "6", "--hs-min-ready", "2", "--num-prefetchers", "2",
        "--bucket-lengths", "64,112", "--log-every", "1", "--save-every", "3", "--no-progress",
        "--cpu-threads", "1", "--stall-timeout", str(STALL_S), "--stop-timeout", "20",
        *extra,
    ]  # fmt: skip


def run_train(argv, capsys, monkeypatch, engine_faults=None) -> tuple[int, str, float]:
    if engine_faults:
        monkeypatch.setenv("DFLASH_FAULTS", json.dumps(engine_faults))  # the engine's plan
    else:
        monkeypatch.delenv("DFLASH_FAULTS", raising=False)
    t0 = time.monotonic()
    code = cli.main(argv)
    err = capsys.readouterr().err
    monkeypatch.delenv("DFLASH_FAULTS", raising=False)
    return code, err, time.monotonic() - t0


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def test_an_engine_that_dies_stops_the_run_with_its_log_and_resume_finishes(
    workspace, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    fault = [{"stage": "engine", "at": 3, "action": "raise"}]
    code, err, _ = run_train(train_argv(workspace, out), capsys, monkeypatch, fault)
    assert code == 1, err[-3000:]
    assert "worker 'target-" in err and "the vLLM engine at http://127.0.0.1:" in err
    assert "injected fault in engine (call 3)" in err  # the engine's own last log lines
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "interrupted or failed"
    assert (out / "engine.log").is_file()  # kept with the run
    assert_no_engine_left(engine_pgids(err))

    code, err, _ = run_train(["train", "--resume", str(out)], capsys, monkeypatch)
    assert code == 0, err[-3000:]
    res = result(out)
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]
    assert [e["trained"] for e in res["accounting"]["per_epoch"]] == [ROWS, ROWS]
    assert_no_engine_left(engine_pgids(err))  # stopped on success too


def test_a_hung_engine_fails_the_run_within_the_stall_timeout(
    workspace, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    fault = [{"stage": "engine", "at": 3, "action": "hang", "seconds": 120, "every": True}]
    code, err, seconds = run_train(train_argv(workspace, out), capsys, monkeypatch, fault)
    deadline = "no features by the request's deadline" in err and code == 1
    watchdog = "no pipeline progress" in err and code == 124
    assert deadline or watchdog, (code, err[-3000:])
    assert "its last log lines" in err  # either way the report quotes the engine
    assert seconds < 240  # engine start-up (30-55 s here) + the stall timeout + stopping
    assert_no_engine_left(engine_pgids(err))


def test_a_slow_engine_is_waited_for_and_the_run_finishes(workspace, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine's environment
    fault = [{"stage": "engine", "at": 3, "action": "sleep", "seconds": 2.0}]
    code, err, _ = run_train(train_argv(workspace, out), capsys, monkeypatch, fault)
    assert code == 0, err[-3000:]
    res = result(out)
    assert res["complete"] and res["accounting"]["finished_epochs_trained_exactly_once"]
    assert "injected" not in err
    assert_no_engine_left(engine_pgids(err))


def test_sigterm_stops_the_run_in_order_and_the_engine_with_it(workspace, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "dflash_train", *train_argv(workspace, out)]
    slow = [{"stage": "engine", "action": "sleep", "seconds": 0.5, "every": True}]
    env = {**os.environ, "DFLASH_FAULTS": json.dumps(slow)}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step within the time limit"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "continue with: dflash-train train --resume" in err
    assert_no_engine_left(engine_pgids(err))


def test_a_target_vllm_cannot_load_is_one_line_and_exit_2(workspace, tmp_path, capsys):
    from dflash_train.model.tiny import save_random_qwen3

    short = save_random_qwen3(
        tmp_path / "short", num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64
    )  # the run's 112-token bucket needs a longer context than the model has
    argv = train_argv(workspace, tmp_path / "run")
    argv[argv.index("--target") + 1] = str(short)
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert "vLLM cannot start on" in lines[0] and "max_model_len" in lines[0]
    assert_no_engine_left(engine_pgids(err))


def test_no_memory_for_the_engines_cache_is_one_line_and_exit_2(
    workspace, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")  # GiB: more than any machine here
    code = cli.main(train_argv(workspace, tmp_path / "run"))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert "vLLM cannot start" in lines[0] and "requested memory for kv" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    assert_no_engine_left(engine_pgids(err))
