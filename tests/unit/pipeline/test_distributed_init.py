"""How a torchrun job's process groups are made, recorded with torch.distributed stood in for:
the NCCL group is bound to the gradients' device and its error handling chosen before it
exists (a multi-node GPU run is checked on GPUs, `tests/cuda`; gloo runs in
`tests/integration/test_multinode.py`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dflash_train.pipeline import distributed
from dflash_train.pipeline.distributed import NodeGroup


@pytest.fixture
def calls(monkeypatch):
    log: list[tuple[str, dict]] = []

    def init(**kwargs):
        env = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        log.append(("init", {**kwargs, "error_handling": env}))

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "new_group", lambda **kw: log.append(("group", kw)) or object())
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    return log


def test_the_nccl_group_is_bound_to_the_gradients_device_and_raises_instead_of_aborting(calls):
    gpu = torch.device("cuda", 1)
    group = NodeGroup.from_env("cuda", 30.0, device=gpu)
    assert group is not None and group.device_backend == "nccl"
    (init, *groups) = calls
    assert init[1]["backend"] == "nccl" and init[1]["device_id"] == gpu
    # Chosen before the group exists: abort the communicator, keep the process (torch's
    # default, 3, ends the process from NCCL's watchdog with nothing saved or closed).
    assert init[1]["error_handling"] == distributed.NCCL_ERROR_HANDLING == "2"
    steps, *host = (kw for _, kw in groups)
    assert steps["backend"] == "nccl" and steps["device_id"] == gpu
    assert all(kw["backend"] == "gloo" and "device_id" not in kw for kw in host)


def test_a_users_own_nccl_error_handling_is_kept(calls, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    NodeGroup.from_env("cuda", 30.0, device=torch.device("cuda", 0))
    assert calls[0][1]["error_handling"] == "1"


def test_gloo_groups_are_not_bound_and_leave_nccls_settings_alone(calls):
    NodeGroup.from_env("cpu", 30.0, device=torch.device("cpu"))
    assert calls[0][1]["backend"] == "gloo" and "device_id" not in calls[0][1]
    assert calls[0][1]["error_handling"] is None


def test_the_train_command_binds_the_group_to_the_first_drafters_device(tiny_target, tmp_path):
    from dflash_train.train.command import first_drafter_device
    from pipeline_helpers import tiny_train_config, write_random_dataset

    data = write_random_dataset(tmp_path / "data", num_rows=4)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", drafter_devices=["cpu", "cpu"])
    assert first_drafter_device(cfg) == torch.device("cpu")
