"""GPU telemetry: silent-but-once without NVML, unit conversion and device mapping with it."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from dflash_train.metrics.telemetry import GpuTelemetry

NO_UUID = lambda index: None  # noqa: E731 (CUDA cannot say: the index path)


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
    with GpuTelemetry([0, 1], uuid_of=NO_UUID) as telemetry:
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
    telemetry = GpuTelemetry([0, 1], uuid_of=NO_UUID)  # without UUIDs: by the visible list
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
    telemetry = GpuTelemetry([0], uuid_of=NO_UUID)
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


def test_devices_are_found_by_uuid_whatever_order_cuda_numbers_them_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA's default) on a machine of mixed GPUs: CUDA's
    # device 0 is NVML's device 1 and the other way round. Found by UUID, each key names the
    # device the trainer means; by index they would be swapped.
    fake = _FakeNvml(monkeypatch)
    nvml_uuids = {"GPU-aaaa": 0, "GPU-bbbb": 1}  # NVML's (PCI) order

    def by_uuid(uuid: str) -> int:
        fake.opened.append(uuid)
        if uuid not in nvml_uuids:
            raise pynvml.NVMLError_NotFound()
        return nvml_uuids[uuid]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda_uuids = {0: "bbbb", 1: "aaaa"}  # torch prints them without the GPU- prefix
    with GpuTelemetry([0, 1], uuid_of=cuda_uuids.get) as telemetry:
        sample = telemetry.sample()
    assert fake.opened == ["GPU-bbbb", "GPU-aaaa"]  # no lookup by index
    assert sample["gpu/0/temp_c"] == 61.0 and sample["gpu/1/temp_c"] == 60.0


def test_a_mig_slice_is_found_by_its_mig_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml(monkeypatch)

    def by_uuid(uuid: str) -> int:
        fake.opened.append(uuid)
        if not uuid.startswith("MIG-"):
            raise pynvml.NVMLError_NotFound()
        return 2

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
    with GpuTelemetry([0], uuid_of=lambda i: "cccc") as telemetry:
        assert telemetry.sample()["gpu/0/temp_c"] == 62.0
    assert fake.opened == ["GPU-cccc", "MIG-cccc"]
