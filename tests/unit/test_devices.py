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


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device


class FakeEvent:
    recorded: list

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        self.recorded.append(stream)


def test_the_segment_clock_records_on_its_own_devices_stream_whatever_the_current_one(
    monkeypatch,
):
    # The main thread's current device is cuda:0 while it warms up or probes a replica on
    # cuda:1: events recorded without a stream would time cuda:0's work.
    recorded: list = []
    monkeypatch.setattr(FakeEvent, "recorded", recorded, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    clock = SegmentClock(torch.device("cuda", 1))
    with clock.segment("drafter_forward_s"):
        pass
    assert [s.device for s in recorded] == [torch.device("cuda", 1)] * 2


def test_on_device_enters_a_cuda_device_and_is_nothing_on_cpu(monkeypatch):
    import contextlib

    from dflash_train.devices import on_device

    entered = []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    with on_device(torch.device("cuda", 3)):
        assert entered == [torch.device("cuda", 3)]
    with on_device(CPU):
        pass
    assert entered == [torch.device("cuda", 3)]
