"""Starting the engine without vLLM: the failures that come before vLLM loads anything are one
line each (no vLLM in that environment, no such interpreter, a port in use, engine arguments that
a flag sets), nothing is left running; on a fake vLLM, /health says what the engine runs and its
hand-over directory goes however the engine ends; the layer-id mapping and the engine options
hold their contract."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.config import EngineOptions, TrainConfig
from dflash_train.engine import layers, protocol
from dflash_train.engine.process import (
    EngineError,
    EngineProcess,
    EngineSpec,
    EngineStartError,
    root_cause,
)
from dflash_train.engine.source import VllmTargetSettings
from dflash_train.model.digest import target_weights_digest
from engine_helpers import fake_vllm_python


def spec(**kw) -> EngineSpec:
    return EngineSpec(
        **{"target": "/nonexistent", "layer_ids": [1, 3], "python": sys.executable, **kw}
    )


def test_an_environment_without_vllm_is_one_line_and_nothing_is_left(tmp_path):
    # This project's own environment has no vLLM (it never enters it).
    with pytest.raises(EngineStartError) as err:
        EngineProcess.start(spec(start_timeout_s=120), say=lambda _m: None)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"exit {protocol.EXIT_NO_VLLM}" in msg and "no working vLLM in" in msg
    assert "log:" in msg


def test_no_such_interpreter_is_one_line():
    with pytest.raises(EngineStartError, match="--vllm-python /no/python: no such interpreter"):
        EngineProcess.start(spec(python="/no/python"), say=lambda _m: None)


def test_a_port_in_use_is_one_line_before_vllm_is_even_imported(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineStartError) as err:
            EngineProcess.start(spec(port=port), say=lambda _m: None)
    assert f"exit {protocol.EXIT_PORT_IN_USE}" in str(err.value)
    assert f"cannot listen on 127.0.0.1:{port}" in str(err.value) and "--port" in str(err.value)


def test_the_server_refuses_bad_layer_ids_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train.engine.server", "--target", "x",
         "--target-layer-ids", "1,a"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == protocol.EXIT_BAD_ARGS
    assert proc.stderr.strip().startswith(protocol.ERROR_PREFIX + "bad --target-layer-ids")


def test_a_start_up_error_that_points_up_the_log_gets_its_root_cause():
    log = [
        "(EngineCore pid=1) ERROR ... RuntimeError: Worker failed with error 'Available memory "
        "on node 0 (1/2 GiB) is less than requested', please check the stack trace above",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert root_cause(log) == "Available memory on node 0 (1/2 GiB) is less than requested"
    assert root_cause(["ValueError: max_model_len 300 > 64", *log[1:]]) == (
        "ValueError: max_model_len 300 > 64"
    )


def test_dflash_layer_i_is_vllm_aux_id_i_plus_1_and_the_order_comes_back():
    assert layers.vllm_aux_ids([4, 0, 2, 2]) == [1, 3, 5]
    assert layers.dflash_ids_of([1, 3, 5]) == [0, 2, 4]
    assert layers.feature_order([4, 0, 2, 2]) == [2, 0, 1, 1]


def test_engine_options_are_checked_at_construction():
    cfg = TrainConfig.from_layers({"target_backend": "vllm", "engine_args": '{"seed": 3}'})
    assert cfg.engine.engine_args_dict == {"seed": 3}
    for bad, field in [
        ({"engine_args": "[1]"}, "engine_args"),
        ({"engine_args": "{"}, "engine_args"),
        ({"target_tp": 0}, "target_tp"),
        ({"target_workers": -1}, "target_workers"),
        ({"target_backend": "sglang"}, "target_backend"),
    ]:
        with pytest.raises(ValueError, match=field):
            TrainConfig.from_layers(bad)


def test_tensor_parallel_on_cpu_binds_each_rank_to_its_own_cores(monkeypatch, tmp_path):
    # vLLM's CPU build binds a rank per NUMA node and refuses TP 2 on one node; the engine's
    # environment splits the cores this process may use instead (a user's own binding wins).
    from dflash_train.engine.process import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [3, 0, 1, 2, 5]) == "0,1,2|3,5"
    with pytest.raises(EngineStartError, match="--target-tp 4 on CPU needs a core per rank"):
        cpu_thread_binding(4, [0, 1])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert spec(tensor_parallel_size=2).environment(tmp_path)["VLLM_CPU_OMP_THREADS_BIND"] == (
        "0,1|2,3"
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" not in spec().environment(tmp_path)
    gpu = spec(tensor_parallel_size=2, cuda_devices=[0, 1]).environment(tmp_path)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in gpu
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")
    assert spec(tensor_parallel_size=2).environment(tmp_path)["VLLM_CPU_OMP_THREADS_BIND"] == "1|0"


def test_the_engine_gets_the_gpus_the_trainer_means_and_a_cpu_engine_none(monkeypatch, tmp_path):
    """Regression: the trainer's device numbers were handed on as they are, though CUDA numbers
    the visible devices from 0: under CUDA_VISIBLE_DEVICES=4,5,6,7 the engine for cuda:0,1
    took GPUs 0 and 1 (another job's); a CPU engine kept the trainer's GPUs visible."""
    from dflash_train.engine.process import engine_visible_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    env = spec(tensor_parallel_size=2, cuda_devices=[0, 1]).environment(tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert spec().environment(tmp_path)["CUDA_VISIBLE_DEVICES"] == ""
    assert engine_visible_devices([1], "GPU-aa, GPU-bb") == "GPU-bb"  # UUIDs passed on
    assert engine_visible_devices([0, 2], None) == "0,2"
    with pytest.raises(EngineStartError, match=r"cuda:2 is not one of this process's GPUs"):
        engine_visible_devices([2], "4,5")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert spec(cuda_devices=[3]).environment(tmp_path)["CUDA_VISIBLE_DEVICES"] == "3"


def handover_dirs() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(protocol.HANDOVER_PREFIX)}


@pytest.fixture
def fake_engine_spec(tiny_target, tmp_path) -> EngineSpec:
    """An engine on a fake vLLM (`engine_helpers.FAKE_VLLM`): it starts, serves /health, stops."""
    python = str(fake_vllm_python(tmp_path / "fake"))
    return spec(python=python, target=str(tiny_target), dtype="float32", max_model_len=96)


def test_health_reports_what_the_engine_runs_and_its_targets_weights(fake_engine_spec, tiny_target):
    engine = EngineProcess.start(fake_engine_spec, say=lambda _m: None)
    try:
        info = engine.info
        assert info["weights_digest"] == target_weights_digest(tiny_target)
        assert (info["hidden_size"], info["dtype"], info["max_model_len"]) == (64, "float32", 96)
        assert info["target_layer_ids"] == [1, 3] and info["handover_ttl_s"] == 60.0
    finally:
        engine.stop()


def test_the_hand_over_directory_goes_however_the_engine_ends(fake_engine_spec):
    engine = EngineProcess.start(fake_engine_spec, say=lambda _m: None)
    directory = Path(engine.info["handover_dir"])
    assert directory.is_dir() and directory.parent == Path("/dev/shm")
    engine.stop()
    assert not directory.exists()
    # Killed with its whole group (the OOM killer, or stop's SIGKILL after its grace): the
    # engine removes nothing then; the launcher does.
    engine = EngineProcess.start(fake_engine_spec, say=lambda _m: None)
    directory = Path(engine.info["handover_dir"])
    (directory / "j0-0.bin").write_bytes(b"\0" * 4096)  # features nobody collected
    os.killpg(engine.pgid, signal.SIGKILL)
    engine.proc.wait(timeout=30)
    assert directory.exists()
    engine.stop()
    assert not directory.exists()


def test_a_stop_that_fails_to_see_the_group_end_still_removes_what_the_engine_held(
    fake_engine_spec, monkeypatch
):
    """Regression: an error while waiting for the group to end (a SIGKILLed GPU worker slow to
    go) skipped the removal of the hand-over directory and shared memory, and a second stop
    did not retry."""
    from dflash_train.engine import process

    engine = EngineProcess.start(fake_engine_spec, say=lambda _m: None)
    directory = Path(engine.info["handover_dir"])

    def slow_to_go(_pgid, timeout_s):
        raise EngineError("engine processes survived SIGKILL")

    monkeypatch.setattr(process, "_wait_group_gone", slow_to_go)
    with pytest.raises(EngineError, match="survived SIGKILL"):
        engine.stop()
    assert not directory.exists() and engine.proc.stdin.closed
    engine.stop()  # again: nothing raised, the work directory gone too
    assert not engine.work_dir.exists()


TRAINER = """
import json, sys, time
from dflash_train.engine.process import EngineProcess, EngineSpec
engine = EngineProcess.start(EngineSpec(**json.loads(sys.argv[1])), say=lambda _m: None)
said = {"dir": engine.info["handover_dir"], "pgid": engine.pgid, "work": str(engine.work_dir)}
print(json.dumps(said), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("straggler", [False, True], ids=["clean", "straggler"])
def test_a_trainer_that_dies_leaves_no_engine_behind(tiny_target, tmp_path, straggler):
    """Regressions: the engine saw its trainer gone (stdin closed) and stopped in order, but
    left the hand-over directory in /dev/shm (the launcher's to remove, and it was dead); and
    an engine process that did not stop with vLLM's shutdown ran on, its shared memory kept."""
    import dataclasses
    import json
    import time

    from dflash_train.engine.protocol import live_group_members

    python = str(fake_vllm_python(tmp_path / "fake", straggler=straggler))
    engine_spec = spec(python=python, target=str(tiny_target), dtype="float32", max_model_len=96)
    spec_json = json.dumps(dataclasses.asdict(engine_spec))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, spec_json], stdout=subprocess.PIPE)
    started = {"work": "", "pgid": 0}
    try:
        started = json.loads(trainer.stdout.readline())
        directory = Path(started["dir"])
        held = Path(f"/dev/shm/fake-vllm-straggler-{started['pgid']}")
        assert directory.is_dir()
        deadline = time.monotonic() + 30
        while straggler and not held.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.exists() == straggler
        trainer.kill()  # the trainer dies: nothing of it runs to clean up
        trainer.wait(timeout=30)
        # Well before the watcher's last resort (PARENT_GONE_GRACE_S, 30 s): a group kill.
        deadline = time.monotonic() + 20
        while live_group_members(started["pgid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not live_group_members(started["pgid"])
        assert not directory.exists()
        assert not held.exists()
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if started["pgid"] and live_group_members(started["pgid"]):
            os.killpg(started["pgid"], signal.SIGKILL)
        Path(f"/dev/shm/fake-vllm-straggler-{started['pgid']}").unlink(missing_ok=True)
        shutil.rmtree(started["work"], ignore_errors=True)  # the engine's log: kept for a user


def test_a_failed_start_leaves_no_hand_over_directory():
    before = handover_dirs()
    with pytest.raises(EngineStartError, match="no working vLLM"):
        EngineProcess.start(spec(start_timeout_s=120), say=lambda _m: None)
    assert handover_dirs() - before == set()


def test_a_hand_over_directory_nobody_holds_is_removed_by_the_next_one(tmp_path):
    # Left by an engine and its launcher both killed: nobody holds its lock any more.
    left = tmp_path / (protocol.HANDOVER_PREFIX + "left")
    left.mkdir()
    (left / protocol.LOCK_FILE).touch()
    (left / "j0-0.bin").write_bytes(b"x" * 100)
    live = tmp_path / (protocol.HANDOVER_PREFIX + "live")
    live.mkdir()
    hold = protocol.hold_handover_dir(live)  # a live engine's (here: this process's)
    new = tmp_path / (protocol.HANDOVER_PREFIX + "new")
    new.mkdir()  # just made, its lock not taken yet
    try:
        assert protocol.remove_abandoned_handover_dirs(tmp_path) == [left]
        assert not left.exists() and live.is_dir() and new.is_dir()
    finally:
        os.close(hold)
    assert protocol.remove_abandoned_handover_dirs(tmp_path) == [live]


def test_engine_arguments_that_a_flag_sets_are_refused_in_one_line():
    # fp16 bytes read as bf16, a shorter context or other layers than /health says: refused.
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train.engine.server", "--target", "x",
         "--target-layer-ids", "1", "--engine-args", '{"dtype": "float16", "max_num_seqs": 4}'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == protocol.EXIT_BAD_ARGS
    assert proc.stderr.strip() == (
        protocol.ERROR_PREFIX + "--engine-args may not set dtype (use instead: dtype: --dtype)"
    )
    options = EngineOptions(
        target_backend="vllm", engine_args='{"tensor_parallel_size": 2, "speculative_config": {}}'
    )
    for key in ("load_format", "hf_config_path", "quantization"):
        # Other weights, another config, quantised weights: features of another model than the
        # one /health names (its digest, dtype and hidden size are the target directory's).
        assert f"may not set {key}" in protocol.engine_args_problem({key: "x"})
    with pytest.raises(ValueError, match="may not set tensor_parallel_size, speculative_config"):
        VllmTargetSettings.from_options(
            options, "t", [1], torch.float32, 64, [torch.device("cpu")], 10.0
        )
