"""Step timing, data-loader wait and model FLOPs utilisation (MFU).

Everything here runs once per training step, so it is plain arithmetic on floats;
torch is imported only when a device has to be looked up.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class StepClock:
    """Measures wall time per step and the part of it spent waiting for data.

    ``wrap(loader)`` times each ``next()`` on the loader; ``lap()`` at the end of every
    step returns ``(step_time_s, data_wait_s)`` since the previous lap. The optional
    callbacks run around each wait, e.g. to mark the heartbeat's ``dataload`` phase.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        on_wait_begin: Callable[[], Any] | None = None,
        on_wait_end: Callable[[], Any] | None = None,
    ):
        self._clock = clock
        self._on_wait_begin = on_wait_begin
        self._on_wait_end = on_wait_end
        self._last: float | None = None
        self._wait = 0.0

    def start(self) -> None:
        """Start (or restart) the step timer; data wait counted so far is discarded."""
        self._last = self._clock()
        self._wait = 0.0

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable``, adding the time each ``next()`` takes to the data wait."""
        items = iter(iterable)
        clock = self._clock
        begin, end = self._on_wait_begin, self._on_wait_end
        while True:
            if begin is not None:
                begin()
            started = clock()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                # Also on StopIteration and on a loader error: the wait happened either way.
                self._wait += clock() - started
                if end is not None:
                    end()
            yield item

    def lap(self) -> tuple[float | None, float]:
        """``(seconds since the previous lap or start(), data-wait seconds since then)``; resets both.

        The step time is None until ``start()`` has been called once (the first lap then starts it).
        """
        now = self._clock()
        step_time = None if self._last is None else now - self._last
        wait = self._wait
        self._last = now
        self._wait = 0.0
        return step_time, wait


# Dense (no 2:4 sparsity) BF16 tensor-core peak per GPU, FP32 accumulate, in FLOP/s; FP16 where the
# GPU has no BF16 (V100, T4). NVIDIA datasheets print the with-sparsity figure first; the dense one
# is half of it. Sources (vendor datasheets / architecture whitepapers):
#   H100 / H200 / GH200 / H800: H100, H200, GH200 datasheets, BF16 1,979 TFLOPS sparse -> 989.5 (SXM);
#     H100 PCIe 1,513 -> 756.5; H100 NVL and H200 NVL 1,671 -> 835.5.
#   B200: HGX B200 datasheet, FP16/BF16 4.5 PFLOPS sparse per GPU -> 2.25 P.
#   A100 (SXM and PCIe): A100 datasheet, BF16 312 dense / 624 sparse.
#   A30 165; A40 149.7; A10 125; RTX A6000 154.8 (309.7 sparse): the respective datasheets.
#   A10G: NVIDIA publishes no datasheet (it is AWS's variant of the A10); the A10 figure is used,
#     which is an upper bound. Pass an override if you know your part's peak.
#   L40S 362.05; L40 181.05; L4 121: Ada datasheets.
#   V100 SXM2 125, PCIe 112, V100S 130; T4 65 (FP16 mixed precision): Volta/Turing datasheets.
#   RTX 4090 165.2; RTX 3090 71: Ada and GA102 whitepapers (GeForce parts run FP32 accumulate at
#     half the FP16-accumulate rate, and training accumulates in FP32).
#   MI300X 1307.4; MI250X 383: AMD Instinct datasheets (ROCm builds of torch report these names).
PEAK_FLOPS: dict[str, float] = {
    "B200": 2250e12,
    "H200": 989.5e12,
    "H200 NVL": 835.5e12,
    "GH200": 989.5e12,
    "H100": 989.5e12,  # the SXM part reports itself as e.g. "NVIDIA H100 80GB HBM3"
    "H100 SXM": 989.5e12,
    "H100 PCIe": 756.5e12,
    "H100 NVL": 835.5e12,
    "H800": 989.5e12,
    "A100": 312e12,
    "A30": 165e12,
    "A40": 149.7e12,
    "A10": 125e12,
    "A10G": 125e12,
    "RTX A6000": 154.8e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "L4": 121e12,
    "V100": 125e12,
    "V100 PCIe": 112e12,
    "V100S": 130e12,
    "T4": 65e12,
    "RTX 4090": 165.2e12,
    "RTX 3090": 71e12,
    "MI300X": 1307.4e12,
    "MI250X": 383e12,
}


def _key_pattern(key: str) -> re.Pattern[str]:
    # A key matches as whole tokens ("A40" must not match "RTX A4000", "A10" not "A10G"); a space in a
    # key also matches "-" or "_", since names spell the form factor either way ("V100-PCIE-32GB").
    body = r"[\s_-]+".join(re.escape(part) for part in key.split())
    return re.compile(rf"(?<![A-Za-z0-9]){body}(?![A-Za-z0-9])", re.IGNORECASE)


_KEY_PATTERNS = {key: _key_pattern(key) for key in PEAK_FLOPS}


def peak_flops_for_name(device_name: str) -> float | None:
    """Table peak for a device name such as ``torch.cuda.get_device_name()``: the longest key found in it."""
    matches = [key for key, pattern in _KEY_PATTERNS.items() if pattern.search(device_name)]
    if not matches:
        return None
    return PEAK_FLOPS[max(matches, key=len)]


def peak_flops(device: Any = None, override: float | None = None) -> float | None:
    """Peak FLOP/s of ``device`` for MFU: ``override`` if given, else the table entry for the CUDA device.

    ``device`` may be a ``torch.device``, ``"cuda:1"``, an index, or None (the current CUDA device, if
    CUDA is already in use). CPU, unknown devices and names not in the table give None: MFU is then absent.
    """
    if override is not None:
        return float(override)
    try:
        import torch

        if device is None:
            # Not initialised means this process is not training on the GPU (yet): no MFU against it.
            if not torch.cuda.is_available():
                return None
            if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call] # torch: unannotated
                return None
            device = torch.cuda.current_device()
        elif not isinstance(device, int):
            device = torch.device(device)
            if device.type != "cuda":
                return None
        return peak_flops_for_name(torch.cuda.get_device_name(device))
    except Exception:  # noqa: BLE001 - no torch, no driver, bad device string: MFU is absent,
        # training goes on
        return None


def transformer_flops_per_step(n_params: int, tokens: int) -> float:
    """Training FLOPs of a dense transformer for ``tokens`` tokens: 6·N·tokens (2 forward + 4 backward).

    Ignores attention's sequence-length term; use the tokens this rank processed in the step.
    """
    return 6.0 * n_params * tokens


def mfu(flops_per_step: float | None, step_time_s: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation, ``flops_per_step / step_time_s / peak``; None if an input is missing,
    non-positive or not finite. All three are per rank (this rank's FLOPs, time and GPU)."""
    if flops_per_step is None or step_time_s is None or peak is None:
        return None
    if any(not math.isfinite(v) or v <= 0 for v in (flops_per_step, step_time_s, peak)):
        return None
    return flops_per_step / step_time_s / peak
