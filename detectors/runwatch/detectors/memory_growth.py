"""Memory that keeps growing: a leak (allocated grows) or fragmentation (reserved - allocated grows
while allocated stays flat), with the projected time until the memory limit is reached.

Per series, a rolling least-squares fit of bytes against event time (river ``Rolling(Cov)`` /
``Rolling(Var)``'s arithmetic, fused in ``_Trend``, over the last ``window`` samples) gives the slope per
second and how straight the growth is (r²). A fit alone also likes a warm-up ramp that has levelled off or a
one-time step up, so growth only counts when it is also *ongoing*: the means of the window's four quarters
rise one after the other, each by a fair share of the total, and the last quarter's lowest sample is above the
first quarter's median (a sawtooth that frees its memory drops below it).

Series: CUDA ``allocated`` (leak; limit: ``device_total``), ``reserved - allocated``
(fragmentation; limit: ``device_total``) and the host's ``host_rss`` (leak; limit:
``cgroup_limit``). On a CPU-only run ``host_rss`` is the only leak series.

Severity: critical when the limit is projected within ``critical_horizon_s``, a warning within
``warn_horizon_s``, and a warning too for steady growth of at least ``min_growth`` (a fraction of
the current value) over the window even when no limit is known.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from datetime import datetime

from pydantic import Field, model_validator

from runwatch.detectors.base import Detector
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.producer.wire.schema import Severity, StepEvent, TelemetryEvent


class MemoryConfig(Strict):
    """Memory growth, leak (allocated grows) versus fragmentation (reserved - allocated
    grows), and time to the limit."""

    enabled: bool = True
    window: int = Field(default=100, ge=8, description="steps in the rolling slope")
    min_points: int = Field(
        default=100,
        ge=8,
        description="samples in the fit before any finding (outlasts the allocator's warm-up)",
    )
    min_growth: float = Field(
        default=0.1,
        gt=0,
        description="growth over the window, as a fraction of the current value, that counts",
    )
    min_r2: float = Field(
        default=0.6, ge=0, le=1, description="how straight the growth must be (a leak is steady)"
    )
    warn_horizon_s: float = Field(
        default=3600.0, gt=0, description="warning if the limit is projected within this"
    )
    critical_horizon_s: float = Field(default=600.0, gt=0, description="critical if projected within this")
    cooldown_steps: int = Field(default=200, ge=0)

    @model_validator(mode="after")
    def _points_fit(self) -> MemoryConfig:
        if self.min_points > self.window:
            raise ValueError(f"min_points ({self.min_points}) must not exceed window ({self.window})")
        if self.critical_horizon_s > self.warn_horizon_s:
            raise ValueError("critical_horizon_s must not exceed warn_horizon_s")
        return self


NAME = "memory_growth"
_MIB = float(1 << 20)  # the fit works in MiB: byte counts squared lose precision in the rolling sums
_SEVERITY = {"warning": 1, "critical": 2}


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Trend:
    """Rolling linear fit of one series (MiB) against time (s), and the samples for the ongoing-growth check.

    The fit's statistics are river's ``Rolling(Cov)``, ``Rolling(Var)`` of t and ``Rolling(Var)`` of the
    value, fused: the same Welford updates and reverts, in the same order, give the same numbers bit for
    bit, but the means of t and of the value (which river keeps twice, in the covariance and in each
    variance) are updated once, and there is no call through river's wrappers for each of them.
    """

    __slots__ = (
        "cov",
        "evicted_max",
        "last_severity",
        "last_step",
        "mean_t",
        "mean_v",
        "n",
        "cooldown",
        "samples",
        "steps",
        "sum_sq_t",
        "sum_sq_v",
        "window",
    )

    def __init__(self, window: int):
        self.window = window
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (t, MiB), oldest first
        self.steps: deque[int] = deque(maxlen=window)
        self.n = 0.0
        self.mean_t = 0.0
        self.mean_v = 0.0
        self.sum_sq_t = 0.0  # Welford's S of t and of the value
        self.sum_sq_v = 0.0
        self.cov = 0.0  # running covariance (ddof 1), as river's Cov
        self.evicted_max = -math.inf  # highest sample that has left the window: the level to beat
        self.last_step = -1
        self.last_severity = 0
        self.cooldown = Cooldown()

    def update(self, t: float, mib: float, step: int) -> None:
        samples = self.samples
        n = self.n
        mean_t, mean_v, cov = self.mean_t, self.mean_v, self.cov
        if len(samples) == self.window:
            old_t, old_v = samples[0]
            if old_v > self.evicted_max:
                self.evicted_max = old_v
            # river's revert of the oldest sample: Mean.revert, Cov.revert, Var.revert
            n -= 1.0
            dt = old_t - mean_t
            dv = old_v - mean_v
            mean_t -= (1.0 / n) * dt
            mean_v -= (1.0 / n) * dv
            denom = n - 1
            cov -= (dt * (old_v - mean_v) - cov) / (denom if denom > 1 else 1)
            self.sum_sq_t -= dt * (old_t - mean_t)
            self.sum_sq_v -= dv * (old_v - mean_v)
        # river's update: Mean.update, Cov.update, Var.update
        n += 1.0
        dt = t - mean_t
        dv = mib - mean_v
        mean_t += (1.0 / n) * dt
        mean_v += (1.0 / n) * dv
        denom = n - 1
        cov += (dt * (mib - mean_v) - cov) / (denom if denom > 1 else 1)
        self.sum_sq_t += dt * (t - mean_t)
        self.sum_sq_v += dv * (mib - mean_v)
        self.n, self.mean_t, self.mean_v, self.cov = n, mean_t, mean_v, cov
        samples.append((t, mib))
        self.steps.append(step)

    def __len__(self) -> int:
        return len(self.steps)

    def fit(self) -> tuple[float, float]:
        """(slope in MiB/s, r²)."""
        n = self.n
        if n <= 1:
            return 0.0, 0.0
        var_t = self.sum_sq_t / (n - 1)
        var_v = self.sum_sq_v / (n - 1)
        if var_t <= 0 or var_v <= 0:
            return 0.0, 0.0
        cov = self.cov
        return cov / var_t, min(1.0, cov * cov / (var_t * var_v))

    def recent_slope(self) -> float:
        """Least-squares slope (MiB/s) over the newer half of the window: the current rate, when the
        growth began inside the window or is speeding up."""
        samples = list(self.samples)[len(self.samples) // 2 :]
        n = len(samples)
        mean_t = sum(t for t, _ in samples) / n
        mean_v = sum(v for _, v in samples) / n
        sxx = sum((t - mean_t) ** 2 for t, _ in samples)
        sxy = sum((t - mean_t) * (v - mean_v) for t, v in samples)
        return sxy / sxx if sxx > 0 else 0.0

    def ongoing(self) -> bool:
        """Growth through the whole window, to a level never seen before: not a ramp that levelled off,
        a one-time step up, or a sawtooth that frees what it took (its next rise only
        returns to the old peak)."""
        values = [v for _, v in self.samples]
        n = len(values) // 4
        quarters = [values[i * n : (i + 1) * n] for i in range(3)] + [values[3 * n :]]
        means = [sum(q) / len(q) for q in quarters]
        total = means[3] - means[0]
        if total <= 0:
            return False
        if any(b - a < total / 6 for a, b in zip(means, means[1:], strict=False)):
            return False
        floor = min(quarters[3])
        return floor > statistics.median(quarters[0]) and floor > self.evicted_max


class MemoryGrowthDetector(Detector):
    """Leak versus fragmentation, with the projected time to the memory limit (see the module doc)."""

    name = NAME

    def __init__(self, config: MemoryConfig):
        self.config = config
        self._t0: datetime | None = None
        self._trends: dict[str, _Trend] = {}

    def _trend(self, metric: str) -> _Trend:
        trend = self._trends.get(metric)
        if trend is None:
            trend = self._trends[metric] = _Trend(self.config.window)
        return trend

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or event.memory is None:
            return []
        mem = event.memory
        if self._t0 is None:
            self._t0 = event.ts
        t = (event.ts - self._t0).total_seconds()
        found: list[Finding] = []
        leak_alloc = None
        if mem.allocated is not None:
            # (arguments: metric, value, t, event, used, limit, base, kind, found, allocated_growth)
            leak_alloc = self._observe(
                "allocated",
                mem.allocated,
                t,
                event,
                mem.reserved or mem.allocated,
                mem.device_total,
                mem.allocated,
                "leak",
                found,
                None,
            )
            if mem.reserved is not None:
                self._observe(
                    "fragmentation",
                    mem.reserved - mem.allocated,
                    t,
                    event,
                    mem.reserved,
                    mem.device_total,
                    mem.reserved,
                    "fragmentation",
                    found,
                    leak_alloc,
                )
        if mem.host_rss is not None:
            self._observe(
                "host_rss",
                mem.host_rss,
                t,
                event,
                mem.cgroup_usage or mem.host_rss,
                mem.cgroup_limit,
                mem.host_rss,
                "leak",
                found,
                None,
            )
        return found

    def _observe(
        self,
        metric: str,
        value: int,
        t: float,
        event: StepEvent,
        used: int,
        limit: int | None,
        base: int,
        kind: str,
        found: list[Finding],
        allocated_growth: float | None,
    ) -> float | None:
        """Feed one sample; append a finding if due. Returns the window's fitted growth (bytes), if known."""
        trend = self._trends.get(metric)
        if trend is None:
            trend = self._trend(metric)
        step = event.step
        if step <= trend.last_step:
            return None  # a replayed or rolled-back step: the series would fold back on itself
        trend.last_step = step
        trend.update(t, value / _MIB, step)
        cfg = self.config
        samples = trend.samples
        if len(samples) < cfg.min_points:
            return None
        slope_mib, r2 = trend.fit()
        span = samples[-1][0] - samples[0][0]
        growth = slope_mib * span * _MIB
        if slope_mib <= 0 or r2 < cfg.min_r2:
            return growth
        if allocated_growth is not None and allocated_growth > growth / 4:
            return growth  # allocated grows too: that is the leak finding's, not fragmentation
        # Project with the faster of the window's and its newer half's rate: a leak that began inside the
        # window, or speeds up, must not look further from the limit than it is.
        rate = max(slope_mib, trend.recent_slope()) * _MIB
        severity, seconds_to_limit = self._severity(rate, growth / max(base, 1), used, limit)
        if severity is None:
            return growth
        rank = _SEVERITY[severity]
        if trend.cooldown.active(event.step) and rank <= trend.last_severity:
            return growth
        if not trend.ongoing():
            return growth
        trend.last_severity = rank
        trend.cooldown.start(event.step, cfg.cooldown_steps)
        found.append(
            self._finding(
                metric, kind, severity, event, value, trend, rate, growth, base, r2, limit, seconds_to_limit
            )
        )
        return growth

    def _severity(
        self, slope: float, fraction: float, used: int, limit: int | None
    ) -> tuple[Severity | None, float | None]:
        cfg = self.config
        seconds_to_limit = None
        if limit is not None and limit > 0:
            seconds_to_limit = max(0.0, (limit - used) / slope)
            if seconds_to_limit <= cfg.critical_horizon_s:
                return "critical", seconds_to_limit
            if seconds_to_limit <= cfg.warn_horizon_s:
                return "warning", seconds_to_limit
        if fraction >= cfg.min_growth:
            return "warning", seconds_to_limit
        return None, seconds_to_limit

    def _finding(
        self,
        metric: str,
        kind: str,
        severity: Severity,
        event: StepEvent,
        value: int,
        trend: _Trend,
        slope: float,
        growth: float,
        base: int,
        r2: float,
        limit: int | None,
        seconds_to_limit: float | None,
    ) -> Finding:
        steps = len(trend)
        what = {
            "allocated": "CUDA allocated memory",
            "fragmentation": "CUDA reserved-but-unallocated memory",
            "host_rss": "host RSS",
        }[metric]
        cause = "a leak" if kind == "leak" else "fragmentation (allocated stays flat)"
        message = (
            f"{what} grows steadily, {cause}: +{_bytes(growth)} over the last {steps} steps "
            f"({growth / max(base, 1):.1%} of {_bytes(base)}, {_bytes(slope)}/s, r² {r2:.2f})"
        )
        if seconds_to_limit is not None and limit is not None:  # (there is a time to the limit only with one)
            message += f"; at this rate the {_bytes(limit)} limit is reached in {_duration(seconds_to_limit)}"
        else:
            message += "; no memory limit is known"
        onset = trend.steps[0]
        return Finding(
            detector=NAME,
            metric=metric,
            step=event.step,
            rank=event.rank,
            severity=severity,
            message=message,
            value=float(value),
            threshold=float(limit) if limit is not None else None,
            score=growth / max(base, 1),
            evidence={
                "kind": kind,
                "slope_bytes_per_s": slope,
                "growth_bytes": growth,
                "growth_fraction": growth / max(base, 1),
                "r2": r2,
                "window_steps": steps,
                "seconds_to_limit": seconds_to_limit,
                "limit_bytes": limit,
                "onset_step": onset,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=MemoryConfig,
        build=lambda d: MemoryGrowthDetector(d.memory_growth),
        view="rank",
        knob="min_growth",
        faults=("memory_leak", "memory_fragmentation"),
        summary="memory growing towards its limit: a leak (allocated) or fragmentation (reserved)",
    )
)
