"""Device helpers: the segment clock groups segments per unit of work and never waits."""

from __future__ import annotations

import time

import pytest
import torch

from dflash_train.devices import SegmentClock, default_devices

CPU = torch.device("cpu")


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
