"""A stand-in for ``pynvml`` (nvidia-ml-py) for the GPU health tests: the functions the sampler calls, with
the constants of nvidia-ml-py 13 (their values are nvml.h's), a device per index whose figures a test sets,
and a record of every call (its name and the thread that made it)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# (nvidia-ml-py's names and values)
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_ERROR_NOT_SUPPORTED = 3
SW_POWER_CAP = 0x4
SW_THERMAL = 0x20
HW_THERMAL = 0x40
GPU_IDLE = 0x1


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):  # (pynvml's name)
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_LibraryNotFound(NVMLError):  # (pynvml's name)
    def __init__(self) -> None:
        super().__init__(12)


@dataclass
class FakeDevice:
    util: int = 97
    mem_util: int = 40
    sm_clock: int = 1980
    sm_clock_max: int = 1980
    reasons: int = 0
    temperature: int = 65
    ecc: tuple[int, int] | None = (0, 0)  # None: not supported (a consumer board)
    power_mw: int = 650_000
    power_limit_mw: int = 700_000


@dataclass
class FakeNvml:
    """``pynvml`` as the sampler uses it. ``devices``: index -> its figures; ``fail_init``: nvmlInit raises
    (no driver); ``calls``: (function, thread ident) of every call."""

    devices: dict[int, FakeDevice] = field(default_factory=lambda: {0: FakeDevice()})
    fail_init: bool = False
    calls: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, value in globals().items():
            if name.startswith("NVML") or name in ("NVMLError",):
                setattr(self, name, value)
        self.nvmlClocksEventReasonGpuIdle = GPU_IDLE
        self.nvmlClocksEventReasonSwPowerCap = SW_POWER_CAP
        self.nvmlClocksEventReasonSwThermalSlowdown = SW_THERMAL
        self.nvmlClocksEventReasonHwThermalSlowdown = HW_THERMAL
        self._lock = threading.Lock()

    def _call(self, name: str) -> None:
        with self._lock:
            self.calls.append((name, threading.get_ident()))

    def threads(self) -> set[int]:
        return {ident for _, ident in self.calls}

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    # -- the API -------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.fail_init:
            raise NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._call("nvmlDeviceGetHandleByIndex")
        if index not in self.devices:
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        self._call("nvmlDeviceGetHandleByUUID")
        return self.devices[int(uuid.rsplit("-", 1)[1])]

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Any:
        self._call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=handle.util, memory=handle.mem_util)

    def nvmlDeviceGetClockInfo(self, handle: FakeDevice, kind: int) -> int:
        self._call("nvmlDeviceGetClockInfo")
        assert kind == NVML_CLOCK_SM
        return handle.sm_clock

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeDevice, kind: int) -> int:
        self._call("nvmlDeviceGetMaxClockInfo")
        assert kind == NVML_CLOCK_SM
        return handle.sm_clock_max

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeDevice) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons")
        return handle.reasons

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature")
        assert sensor == NVML_TEMPERATURE_GPU
        return handle.temperature

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeDevice, error_type: int, counter: int) -> int:
        self._call("nvmlDeviceGetTotalEccErrors")
        if handle.ecc is None:
            raise NVMLError_NotSupported()
        assert counter == NVML_VOLATILE_ECC
        return handle.ecc[error_type]

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        self._call("nvmlDeviceGetPowerUsage")
        return handle.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeDevice) -> int:
        self._call("nvmlDeviceGetEnforcedPowerLimit")
        return handle.power_limit_mw
