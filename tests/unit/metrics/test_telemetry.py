"""GPU telemetry: silent-but-once without NVML, unit conversion and device mapping with it."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from dflash_train.metrics.telemetry import GpuTelemetry


def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", fail)


def test_without_nvml_sample_is_empty_and_one_line_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_nvml(monkeypatch)  # as on this CPU machine, but also where a GPU machine runs the test
    telemetry = GpuTelemetry([0, 1])
    assert [telemetry.sample() for _ in range(3)] == [{}, {}, {}]
    telemetry.close()
    assert telemetry.sample() == {}
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "GPU telemetry off" in err


class _FakeNvml:
    """Stands in for the NVML calls GpuTelemetry makes; devices are keyed by NVML index."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[int | str] = []
        self.shutdowns = 0
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTemperature",
        ):
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.opened.append(index)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        self.opened.append(uuid)
        return 7

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=90 + h, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(40 + h) * 10**9, total=80 * 10**9, free=0)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 3:
            raise pynvml.NVMLError_NotSupported()
        return 450_000 + h  # milliwatts

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 60 + h


def test_sample_reports_units_per_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with GpuTelemetry([0, 1]) as telemetry:
        sample = telemetry.sample()
    assert sample == {
        "gpu/0/util_pct": 90.0,
        "gpu/0/mem_used_gb": 40.0,
        "gpu/0/power_w": 450.0,
        "gpu/0/temp_c": 60.0,
        "gpu/1/util_pct": 91.0,
        "gpu/1/mem_used_gb": 41.0,
        "gpu/1/power_w": pytest.approx(450.001),
        "gpu/1/temp_c": 61.0,
    }
    assert fake.shutdowns == 1


def test_cuda_visible_devices_maps_trainer_indices_to_nvml_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeNvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-1234abcd")
    telemetry = GpuTelemetry([0, 1])
    assert fake.opened == [3, "GPU-1234abcd"]
    sample = telemetry.sample()
    # Keys use the trainer's numbering; device 0 is NVML device 3, whose power is unsupported.
    assert "gpu/0/power_w" not in sample and sample["gpu/0/temp_c"] == 63.0
    assert sample["gpu/1/temp_c"] == 67.0
    telemetry.close()


def test_a_failing_query_is_left_out_and_reported_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _FakeNvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def lost(h: int, sensor: int) -> int:
        raise pynvml.NVMLError_GpuIsLost()

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lost)
    telemetry = GpuTelemetry([0])
    samples = [telemetry.sample() for _ in range(3)]
    telemetry.close()
    assert all("gpu/0/temp_c" not in s and "gpu/0/util_pct" in s for s in samples)
    assert capsys.readouterr().err.count("gpu/0/temp_c") == 1


def test_real_nvml_or_its_absence_never_raises(capsys: pytest.CaptureFixture[str]) -> None:
    telemetry = GpuTelemetry([0])
    sample = telemetry.sample()
    telemetry.close()
    if sample:  # a machine with an NVIDIA GPU
        assert 0 <= sample["gpu/0/util_pct"] <= 100 and sample["gpu/0/mem_used_gb"] >= 0
    else:
        assert "GPU telemetry off" in capsys.readouterr().err
