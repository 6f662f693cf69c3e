"""Device helpers: dtype names and device lists (one table, one parser, clear errors), and the
segment clock (groups segments per unit of work and never waits)."""

from __future__ import annotations

import time

import pytest
import torch

from dflash_train.devices import (
    DTYPES,
    SegmentClock,
    default_devices,
    parse_devices,
    parse_dtype,
    resolve_dtype,
)

CPU = torch.device("cpu")


def test_dtype_names_map_to_torch_dtypes_and_auto_follows_the_device():
    assert {name: parse_dtype(name) for name in DTYPES} == DTYPES
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \['bfloat16', 'float16', 'float32'\]"):
        parse_dtype("fp8")
    with pytest.raises(ValueError, match="auto or one of"):
        resolve_dtype("auto-ish", CPU)


def test_device_lists_are_parsed_and_checked():
    assert parse_devices("cpu, cpu", "--devices") == [CPU, CPU]
    with pytest.raises(ValueError, match="--devices: at least one device"):
        parse_devices(" , ", "--devices")
    with pytest.raises(ValueError, match="not a device name"):
        parse_devices("gpu0", "--devices")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        parse_devices("meta", "--devices")


def test_segments_sum_per_name_within_a_group_and_groups_come_out_oldest_first():
    clock = SegmentClock(CPU)
    for _ in range(3):  # one micro-batch of three chunks
        with clock.segment("forward"):
            time.sleep(0.01)
    clock.end_group()
    with clock.segment("optimizer"):
        pass
    clock.end_group()
    with clock.segment("forward"):  # still open: not harvested
        pass
    first, second = clock.harvest()
    assert set(first) == {"forward"} and first["forward"] >= 0.03
    assert set(second) == {"optimizer"}
    assert clock.harvest() == []
    clock.end_group()
    assert [set(g) for g in clock.harvest(wait=True)] == [{"forward"}]


def test_default_devices_without_cuda_are_cpu_and_explicit_lists_win():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU defaults")
    targets, drafters = default_devices(None, None)
    assert targets == [CPU] and drafters == [CPU]
    assert default_devices(["cpu"], ["cpu", "cpu"])[1] == [CPU, CPU]
