"""GPU health for the heartbeat: utilisation, SM clock, throttle reasons, temperature, ECC errors, power.

Where ``nvidia-ml-py`` is installed (the optional ``gpu`` extra; its module is ``pynvml``), a watched CUDA
model's heartbeat carries ``gpu`` (wire ``GpuHealth``): what NVML says of the device this rank uses, so that
the worker can say of a straggler, a throughput drift or a hung rank "rank 2: thermal throttle since
12:04:11 (SM clock 1110 of 1980 MHz)".

Off the training thread. :class:`GpuHealthSampler` does nothing when it is made (the watcher makes it on the
training thread): ``pynvml`` is imported, ``nvmlInit`` called and the device's handle looked up at the first
:meth:`~GpuHealthSampler.sample`, which the heartbeat thread calls at each beat. A device is asked at most
once a second (``MIN_INTERVAL_S``): a beat sooner than that (a phase announced at once) gets the cached
sample. Each sample is about ten NVML queries of a few microseconds each.

Never raises. No ``pynvml``, no driver (``NVMLError_LibraryNotFound``, ``NVMLError_DriverNotLoaded``), no
such device: the sampler is off for good, logged once, and heartbeats carry no ``gpu``. A query the device
does not support (ECC on most consumer boards, power on some) leaves that figure out from then on; a query
that fails otherwise leaves it out of that sample (logged once). A figure that is not known is absent,
never zero.

The device: an NVML index (``int``) or a UUID (``"GPU-..."`` / ``"MIG-..."``), from
:func:`nvml_device_for` (the CUDA device's UUID where torch gives it, so that ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER`` cannot point it at another GPU). ``nvml``: the module to use (tests pass a fake);
None imports ``pynvml``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0  # a device is sampled at most once per this many seconds

# NVML's clock event ("throttle") reason bits (nvml.h ``nvmlClocksEventReason*``, named
# ``nvmlClocksThrottleReason*`` before NVML 12.535), by the name the wire and the worker use. The bits are
# read from the module where it has the constant, else these (nvml.h's values).
THROTTLE_REASONS: tuple[tuple[str, str, int], ...] = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake", "HwPowerBrakeSlowdown", 0x80),
    ("display_clocks", "DisplayClockSetting", 0x100),
    ("board_limit", "BoardLimit", 0x200),
    ("reliability", "Reliability", 0x400),
)
UNKNOWN_REASON = "other"  # bits this table does not name

# NVML's enum values (nvml.h), where the module lacks the constant
_NVML_CLOCK_SM = 1
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0


def _constant(nvml: Any, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


def reason_bits(nvml: Any) -> tuple[tuple[str, int], ...]:
    """(name, bit) for each reason, the bit as ``nvml`` defines it (either spelling) or nvml.h's."""
    out = []
    for name, suffix, bit in THROTTLE_REASONS:
        value = getattr(nvml, f"nvmlClocksEventReason{suffix}", None)
        if not isinstance(value, int):
            value = getattr(nvml, f"nvmlClocksThrottleReason{suffix}", bit)
        out.append((name, value if isinstance(value, int) and value > 0 else bit))
    return tuple(out)


def decode_reasons(mask: int, bits: tuple[tuple[str, int], ...] | None = None) -> list[str]:
    """The names of the reasons set in ``mask`` (``other`` for bits none names), in the table's order."""
    table = bits if bits is not None else tuple((n, b) for n, _, b in THROTTLE_REASONS)
    names = [name for name, bit in table if mask & bit]
    known = 0
    for _, bit in table:
        known |= bit
    if mask & ~known:
        names.append(UNKNOWN_REASON)
    return names


def _is_not_supported(nvml: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is NVML's "not supported" (the device lacks the feature: never ask again)."""
    cls = getattr(nvml, "NVMLError_NotSupported", None)
    if isinstance(cls, type) and isinstance(exc, cls):
        return True
    code = getattr(exc, "value", None)
    return code is not None and code == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)


class GpuHealthSampler:
    """``sample()`` -> the ``gpu`` of a heartbeat (wire ``GpuHealth`` fields), or None (see the module doc).

    ``device``: the NVML index or UUID of the rank's GPU; ``cuda_device``: the CUDA ordinal the rank uses
    (sent as ``device``; None: ``device`` where it is an index). ``nvml``: the NVML module (None: import
    ``pynvml`` at the first sample). ``clock``: for the once-a-second rule."""

    def __init__(
        self,
        device: int | str = 0,
        *,
        cuda_device: int | None = None,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
        min_interval_s: float = MIN_INTERVAL_S,
    ):
        self.device = device
        if cuda_device is None and isinstance(device, int):
            cuda_device = device
        self.cuda_device = cuda_device
        self._nvml = nvml
        self._clock = clock
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()  # (the heartbeat thread is the only caller; a second one waits)
        self._handle: Any = None
        self._bits: tuple[tuple[str, int], ...] = ()
        self.failed: str | None = None  # why the sampler is off for good
        self._unsupported: set[str] = set()  # queries the device does not support
        self._warned = False
        self._last: tuple[float, dict[str, Any] | None] | None = None  # (when, what) of the latest sample
        self.samples = 0  # NVML samples taken (not the cached answers)

    @property
    def active(self) -> bool:
        return self.failed is None

    def sample(self) -> dict[str, Any] | None:
        """The latest figures (at most ``min_interval_s`` old, else sampled now); None when off or unknown."""
        if self.failed is not None:
            return None
        with self._lock:
            now = self._clock()
            last = self._last
            if last is not None and now - last[0] < self.min_interval_s:
                return None if last[1] is None else dict(last[1])
            try:
                figures = self._sample()
            except Exception as exc:  # noqa: BLE001 - a sampler that fails is absent, never a lost heartbeat
                self._off(f"sampling failed: {exc!r}")
                return None
            self._last = (now, figures)
            return None if figures is None else dict(figures)

    def _off(self, why: str) -> None:
        self.failed = why
        self._handle = None
        log.warning("runwatch: GPU health is off for device %s (%s)", self.device, why)

    def _open(self) -> Any:
        """pynvml, initialised, with the device's handle; None (and off for good) where that fails."""
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml  # type: ignore[import-not-found,unused-ignore]  # the `gpu` extra (nvidia-ml-py)
            except ImportError:
                self._off("nvidia-ml-py is not installed: pip install 'runwatch[gpu]'")
                return None
            nvml = self._nvml = pynvml
        try:
            nvml.nvmlInit()
            device = self.device
            if isinstance(device, str):
                self._handle = nvml.nvmlDeviceGetHandleByUUID(device)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(device)
        except Exception as exc:  # noqa: BLE001 - no driver, no such device: off, logged once
            self._off(f"NVML unavailable: {exc!r}")
            return None
        self._bits = reason_bits(nvml)
        return nvml

    def _query(self, nvml: Any, name: str, *args: Any) -> Any:
        """``nvml.<name>(handle, *args)``; None where the device does not support it (remembered) or it
        failed (logged once)."""
        if name in self._unsupported:
            return None
        fn = getattr(nvml, name, None)
        if fn is None:
            self._unsupported.add(name)  # (an older nvidia-ml-py)
            return None
        try:
            return fn(self._handle, *args)
        except Exception as exc:  # noqa: BLE001 - one figure that fails is absent from this sample
            if _is_not_supported(nvml, exc):
                self._unsupported.add(name)
            elif not self._warned:
                self._warned = True
                log.warning("runwatch: NVML %s failed (further failures are not logged): %r", name, exc)
            return None

    def _sample(self) -> dict[str, Any] | None:
        nvml = self._nvml if self._handle is not None else self._open()
        if nvml is None:
            return None
        self.samples += 1
        out: dict[str, Any] = {}
        if self.cuda_device is not None:
            out["device"] = self.cuda_device
        util = self._query(nvml, "nvmlDeviceGetUtilizationRates")
        if util is not None:
            _put(out, "util_pct", getattr(util, "gpu", None), 0, 100)
            _put(out, "mem_util_pct", getattr(util, "memory", None), 0, 100)
        sm = _constant(nvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM)
        _put(out, "sm_clock_mhz", self._query(nvml, "nvmlDeviceGetClockInfo", sm), 0, 100_000)
        _put(out, "sm_clock_max_mhz", self._query(nvml, "nvmlDeviceGetMaxClockInfo", sm), 0, 100_000)
        mask = self._query(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:  # (before NVML 12.535, and its deprecated name since)
            mask = self._query(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
        if isinstance(mask, int) and 0 <= mask < 1 << 64:
            out["throttle_mask"] = mask
            out["throttle_reasons"] = decode_reasons(mask, self._bits)
        temp = _constant(nvml, "NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
        _put(out, "temperature_c", self._query(nvml, "nvmlDeviceGetTemperature", temp), -100, 300)
        volatile = _constant(nvml, "NVML_VOLATILE_ECC", _NVML_VOLATILE_ECC)
        for key, kind, default in (
            ("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED", _NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", _NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            count = self._query(nvml, "nvmlDeviceGetTotalEccErrors", _constant(nvml, kind, default), volatile)
            if isinstance(count, int) and 0 <= count < 1 << 63:
                out[key] = count
        # (milliwatts in NVML)
        _put(out, "power_w", _milli(self._query(nvml, "nvmlDeviceGetPowerUsage")), 0, 100_000)
        _put(out, "power_limit_w", _milli(self._query(nvml, "nvmlDeviceGetEnforcedPowerLimit")), 0, 100_000)
        if len(out) <= ("device" in out):
            return None  # (nothing measured)
        from runwatch.contract.schema import GpuHealth

        GpuHealth(**out)  # within the wire's bounds, or (raising) none at all: never a dropped heartbeat
        return out

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``); the heartbeat thread calls it as it ends. Never raises."""
        nvml, handle = self._nvml, self._handle
        self._handle = None
        if handle is not None and nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - nothing to do about a shutdown that fails
                pass


def _milli(value: Any) -> float | None:
    return value / 1000.0 if isinstance(value, int | float) and not isinstance(value, bool) else None


def _put(out: dict[str, Any], key: str, value: Any, low: float, high: float) -> None:
    """``out[key] = value`` where it is a finite number within [low, high] (NVML's odd answers left out)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if not math.isfinite(value) or not low <= value <= high:
        return
    out[key] = round(value, 3) if isinstance(value, float) else value


def nvml_device_for(cuda_index: int) -> int | str:
    """The NVML name of CUDA device ``cuda_index`` as this process sees it: its UUID where torch gives one
    (``GPU-...``), else the ``CUDA_VISIBLE_DEVICES`` entry it stands for (an index or a UUID), else the index
    itself (right where every GPU is visible in PCI order). Calls torch, never NVML."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    except Exception:  # noqa: BLE001 - no CUDA, an older torch: the environment decides
        uuid = None
    if uuid is not None:
        text = str(uuid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if 0 <= cuda_index < len(entries):
            entry = entries[cuda_index]
            return int(entry) if entry.isdigit() else entry
    return cuda_index
