"""GPU telemetry through NVML: utilisation, memory, power and temperature per device.

Telemetry is advisory: it must never stop a training run. Without NVIDIA drivers (CPU machines,
CI) it prints one informational line and then returns no samples; a query a device does not
support is left out of its sample.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from dflash_train import faults

# NVML reports memory in bytes and power in milliwatts; the logged keys use GB and W.
_BYTES_PER_GB = 1e9
_MW_PER_W = 1000.0


def _nvml_id(index: int, visible: str | None) -> int | str | None:
    """NVML index or UUID of CUDA device `index` under CUDA_VISIBLE_DEVICES=`visible`.

    CUDA renumbers the visible devices from 0, NVML does not: with CUDA_VISIBLE_DEVICES=2,3 the
    trainer's device 0 is NVML device 2. Entries that are not integers are UUIDs (GPU-..., MIG-...).
    None when `index` is not among the visible devices.
    """
    if visible is None or not visible.strip():
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= index < len(entries):
        return None
    return int(entries[index]) if entries[index].isdigit() else entries[index]


def cuda_uuid(index: int) -> str | None:
    """The UUID CUDA reports for its device `index` (None where it cannot say: no CUDA)."""
    try:
        import torch

        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # no CUDA build, no driver, no such device: fall back to the index
        return None


def _uuid_names(uuid: str) -> list[str]:
    """NVML's spellings of a CUDA UUID: torch prints it bare, NVML names a whole GPU "GPU-..."
    and a MIG slice "MIG-..."."""
    if uuid.startswith(("GPU-", "MIG-")):
        return [uuid]
    return [f"GPU-{uuid}", f"MIG-{uuid}"]


class GpuTelemetry:
    """Samples NVML for the given CUDA device indices (as the trainer numbers them).

    `sample()` returns `gpu/{i}/util_pct` (0-100), `gpu/{i}/mem_used_gb` (1e9 bytes),
    `gpu/{i}/power_w` and `gpu/{i}/temp_c`, or `{}` when NVML is unavailable. Call it at log steps
    only: each query is a driver call of some microseconds per device.

    Devices are found by UUID (`uuid_of`: CUDA index -> UUID, torch's by default): CUDA's
    ordinals follow CUDA_DEVICE_ORDER (fastest first by default) and CUDA_VISIBLE_DEVICES,
    NVML's the PCI bus, so index i is not NVML's device i on a machine of mixed GPUs. Without a
    UUID, the index is mapped through CUDA_VISIBLE_DEVICES as before.
    """

    def __init__(
        self,
        device_indices: list[int],
        *,
        stream: TextIO | None = None,
        uuid_of: Callable[[int], str | None] = cuda_uuid,
    ) -> None:
        self.device_indices = list(device_indices)
        self._uuid_of = uuid_of
        self._stream = stream or sys.stderr
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._warned_errors: set[str] = set()
        if not self.device_indices:
            self._info("GPU telemetry off: no GPU devices in this run")
            return
        try:
            import pynvml
        except ImportError:
            self._info('GPU telemetry off: pynvml missing (pip install "nvidia-ml-py")')
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self._info(f"GPU telemetry off: NVML is not available on this machine ({e})")
            return
        self._nvml = pynvml
        self._open_handles()

    def _info(self, message: str) -> None:
        print(message, file=self._stream, flush=True)

    def _open_handles(self) -> None:
        nvml = self._nvml
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        for i in self.device_indices:
            handle = self._handle_by_uuid(i)
            if handle is not None:
                self._handles[i] = handle
                continue
            nvml_id = _nvml_id(i, visible)
            if nvml_id is None:
                self._info(f"GPU telemetry off for device {i}: CUDA_VISIBLE_DEVICES={visible}")
                continue
            try:
                if isinstance(nvml_id, int):
                    self._handles[i] = nvml.nvmlDeviceGetHandleByIndex(nvml_id)
                else:
                    self._handles[i] = nvml.nvmlDeviceGetHandleByUUID(nvml_id)
            except nvml.NVMLError as e:
                self._info(f"GPU telemetry off for device {i} (NVML id {nvml_id}): {e}")
        if not self._handles:
            self.close()

    def _handle_by_uuid(self, index: int) -> Any:
        uuid = self._uuid_of(index)
        for name in _uuid_names(uuid) if uuid else []:
            try:
                return self._nvml.nvmlDeviceGetHandleByUUID(name)
            except self._nvml.NVMLError:
                continue
        return None

    @property
    def enabled(self) -> bool:
        """Whether `sample()` can return anything."""
        return bool(self._handles)

    def sample(self) -> dict[str, float]:
        """Current readings of every device; `{}` when telemetry is off."""
        faults.point("telemetry")
        out: dict[str, float] = {}
        for i, handle in self._handles.items():
            for name, query in self._queries():
                value = self._query(i, name, query, handle)
                if value is not None:
                    out[f"gpu/{i}/{name}"] = value
        return out

    def _queries(self) -> list[tuple[str, Any]]:
        nvml = self._nvml
        return [
            ("util_pct", lambda h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)),
            ("mem_used_gb", lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / _BYTES_PER_GB),
            ("power_w", lambda h: nvml.nvmlDeviceGetPowerUsage(h) / _MW_PER_W),
            (
                "temp_c",
                lambda h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            ),
        ]

    def _query(self, i: int, name: str, query: Any, handle: Any) -> float | None:
        nvml = self._nvml
        try:
            return query(handle)
        except nvml.NVMLError_NotSupported:
            return None  # e.g. power or utilisation on MIG slices: simply not reported
        except nvml.NVMLError as e:
            # A flaky driver query must not end a long run; say so once per device and metric.
            key = f"{i}/{name}"
            if key not in self._warned_errors:
                self._warned_errors.add(key)
                self._info(f"GPU telemetry: gpu/{key} unavailable ({e}); leaving it out")
            return None

    def close(self) -> None:
        """Release NVML; `sample()` returns `{}` afterwards."""
        self._handles.clear()
        if self._nvml is not None:
            nvml, self._nvml = self._nvml, None
            nvml.nvmlShutdown()

    def __enter__(self) -> GpuTelemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
