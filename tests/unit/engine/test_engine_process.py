"""Starting the engine without vLLM: the failures that come before vLLM loads anything are one
line each (no vLLM in that environment, no such interpreter, a port in use), nothing is left
running, and the layer-id mapping and the engine options hold their contract."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from dflash_train.config import TrainConfig
from dflash_train.engine import layers, protocol
from dflash_train.engine.process import EngineProcess, EngineSpec, EngineStartError, root_cause


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
