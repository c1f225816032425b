"""Memory that keeps growing: a leak (allocated grows) or fragmentation (reserved - allocated grows
while allocated stays flat), with the projected time until the memory limit is reached.

A sequential test per series, not a fixed window: a one-sided CUSUM of the step-to-step changes, each
divided by a robust scale of the series' recent changes (their median size, with a floor at a small
fraction of the level: a series that never moved still has a resolution) and clipped to a few scales, so
one jump (a batch-size increase, an eval's buffers) counts as little as a few ordinary steps. Growth
accumulates it; a change below ``allowance`` scales never does. The steps since the CUSUM last left zero
are the growth episode: its first step is the onset, its least-squares fit (over at most ``window`` of
its samples) the rate. The episode ends when the CUSUM is back at zero (a freed buffer's drop takes it
there). The test starts after ``min_points`` samples (the allocator's warm-up).

A finding needs the CUSUM at ``threshold``, growth for ``min_steps`` steps, and growth that is *ongoing*
and *new*: the means of the fit's four quarters rise one after the other, each by a fair share of the
total, and the last quarter's lowest sample is above the first quarter's median and above every sample
before the fit (the history before the onset, and the episode's own samples the fit has let go). A level
compared with its own past, minimum against maximum, is what keeps host RSS that swings around evals and
checkpoints quiet: memory an eval or a checkpoint takes and gives back, or a cache refilled after a
checkpoint dropped it, never climbs past the level it had before; a leak does, and keeps climbing.

What is tested is the memory of the *training steps*: a rise across a step that contained an eval or a
checkpoint (an ``eval`` or ``checkpoint`` event, or a heartbeat in that phase, since the step before)
is the phase's, not the training's, and is set aside: the series goes on from where it was, as if that
step had not moved it (no CUSUM score, no higher level for a leak to beat, no growth in the fit). An
eval whose larger batches raise the allocator's high-water mark (a ratchet that plateaus) or a
checkpoint serialised into a buffer the allocator keeps is then not a leak, even where it lands in a
cache's refill and lifts it past the level it had. A fall is counted wherever it happens (memory given
back is never evidence of growth), and at most one step in ``min_steps`` is set aside, so a leak in the
training steps keeps nearly all its growth however often the run evaluates.

Series: CUDA ``allocated`` (leak; limit: ``device_total``), ``reserved - allocated``
(fragmentation; limit: ``device_total``) and the host's ``host_rss`` (leak; limit:
``cgroup_limit``). On a CPU-only run ``host_rss`` is the only leak series.

Severity: critical when the limit is projected within ``critical_horizon_s``, a warning within
``warn_horizon_s``, and a warning too for steady growth of at least ``min_growth`` (a fraction of
the current value) over the fit even when no limit is known.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from datetime import datetime
from typing import Any, cast

from pydantic import Field, model_validator

from runwatch.contract.schema import (
    CheckpointEvent,
    EvalEvent,
    HeartbeatEvent,
    Severity,
    StepEvent,
    TelemetryEvent,
)
from runwatch.detectors.base import Detector
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import MAD_TO_SIGMA


class MemoryConfig(Strict):
    """Memory growth, leak (allocated grows) versus fragmentation (reserved - allocated
    grows), and time to the limit."""

    enabled: bool = True
    window: int = Field(
        default=100,
        ge=8,
        description="steps of history: the scale of the changes, the level to beat, the longest fit",
    )
    min_points: int = Field(
        default=100,
        ge=8,
        description="samples before the test starts (outlasts the allocator's warm-up)",
    )
    min_steps: int = Field(default=10, ge=4, description="steps the growth must have lasted before a finding")
    threshold: float = Field(
        default=8.0, gt=0, description="CUSUM of the changes, in scales, that makes the growth clear"
    )
    allowance: float = Field(
        default=0.25, ge=0, description="change per step, in scales, that the CUSUM lets pass"
    )
    min_growth: float = Field(
        default=0.1,
        gt=0,
        description="growth over the fit, as a fraction of the current value, that counts",
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
        if self.min_steps > self.window:
            raise ValueError(f"min_steps ({self.min_steps}) must not exceed window ({self.window})")
        if self.critical_horizon_s > self.warn_horizon_s:
            raise ValueError("critical_horizon_s must not exceed warn_horizon_s")
        return self


NAME = "memory_growth"
_MIB = float(1 << 20)  # the series are kept in MiB: byte counts squared lose precision in the fit
_SEVERITY = {"warning": 1, "critical": 2}
_CLIP = 3.0  # one step's change counts at most this many scales: a single jump is not a trend
_CAP = 2.0  # the CUSUM stops at this many thresholds, so it falls back soon after the growth stops
_REL_FLOOR = 1e-4  # the scale is at least this fraction of the level (a flat series has a resolution too)
_ABS_FLOOR_MIB = 512 / _MIB  # and at least the CUDA allocator's rounding, for a level near zero
_PHASES = ("eval", "checkpoint")  # a heartbeat in one of these: the next step's memory rise is the phase's


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


def _fit(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares of MiB against seconds: (slope in MiB/s, r², the slope's standard error)."""
    n = len(samples)
    if n < 3:
        return 0.0, 0.0, math.inf
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in samples)
    syy = sum((v - mean_v) ** 2 for _, v in samples)
    sxy = sum((t - mean_t) * (v - mean_v) for t, v in samples)
    if sxx <= 0 or syy <= 0:
        return 0.0, 0.0, math.inf
    slope = sxy / sxx
    residual = max(0.0, syy - slope * sxy)
    return slope, min(1.0, sxy * sxy / (sxx * syy)), math.sqrt(residual / (n - 2) / sxx)


def _ongoing(values: list[float], level_to_beat: float) -> bool:
    """Growth through the whole fit, to a level never seen before: not a ramp that levelled off, a
    one-time step up, or memory that only comes back to where it was (a sawtooth's next rise, a cache
    refilled after a checkpoint)."""
    n = len(values) // 4
    quarters = [values[i * n : (i + 1) * n] for i in range(3)] + [values[3 * n :]]
    means = [sum(q) / len(q) for q in quarters]
    total = means[3] - means[0]
    if total <= 0:
        return False
    if any(b - a < total / 6 for a, b in zip(means, means[1:], strict=False)):
        return False
    floor = min(quarters[3])
    return floor > statistics.median(quarters[0]) and floor > level_to_beat


class _Trend:
    """The fixed-window fit this detector kept before the sequential test: only so that a snapshot
    taken then still loads (``MemoryGrowthDetector.__setstate__`` drops it)."""


class _Series:
    """One memory series (MiB against seconds): its recent history, the robust scale of its changes,
    the CUSUM of those changes and the growth episode it is in."""

    __slots__ = (
        "changes",
        "cooldown",
        "cusum",
        "episode",
        "episode_steps",
        "history",
        "last_set_aside",
        "last_severity",
        "last_step",
        "level_to_beat",
        "levels",
        "onset",
        "seen",
        "set_aside",
        "sorted_changes",
    )

    def __init__(self, window: int):
        # The samples are the training steps' memory: the measured MiB less ``set_aside``.
        self.history: deque[tuple[int, float, float]] = deque(maxlen=window)  # (step, t, MiB), oldest first
        # The history's MiB alone: their max is taken each time the CUSUM leaves zero (often, on a noisy
        # series), and max() over plain floats costs a third of a generator over the tuples.
        self.levels: deque[float] = deque(maxlen=window)
        self.changes: deque[float] = deque(maxlen=window)  # |change| per step, oldest first
        self.sorted_changes: list[float] = []  # the same, sorted: their median is the scale
        self.seen = 0
        self.last_step = -1
        self.cusum = 0.0  # in scales
        self.onset: int | None = None  # the episode's first step (None: not growing)
        self.level_to_beat = -math.inf  # highest sample before the fit
        self.episode: deque[tuple[float, float]] = deque(maxlen=window)  # the fit: (t, MiB) since the onset
        self.episode_steps = 0
        self.last_severity = 0
        self.cooldown = Cooldown()
        self.set_aside = 0.0  # MiB risen across eval and checkpoint steps: the phases', not the training's
        self.last_set_aside: int | None = None  # the step whose rise was last set aside

    @staticmethod
    def _defaults() -> dict[str, Any]:
        """Slots a snapshot from before them lacks."""
        return {"set_aside": 0.0, "last_set_aside": None}

    def __setstate__(self, state: tuple[None, dict[str, Any]]) -> None:
        """A snapshot of ``__slots__`` (``(None, slots)``); one taken before ``levels`` existed gets
        them from its history, one from before the phases' rises were set aside sets none aside yet."""
        _, slots = state
        for name, value in {**self._defaults(), **slots}.items():
            setattr(self, name, value)
        if "levels" not in slots:
            self.levels = deque((v for _, _, v in self.history), maxlen=self.history.maxlen)

    def scale(self, level: float) -> float:
        """MiB that one ordinary step moves the series by."""
        ordered, n = self.sorted_changes, len(self.sorted_changes)
        median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2 if n else 0.0
        return max(median * MAD_TO_SIGMA, abs(level) * _REL_FLOOR, _ABS_FLOOR_MIB)

    def observe(self, step: int, t: float, measured: float, cfg: MemoryConfig, phase: bool = False) -> bool:
        """Take one sample (``phase``: an eval or a checkpoint came since the last one); whether the
        series is in a growth episode now (the rest of the test is due)."""
        levels = self.levels
        mib = measured - self.set_aside
        if phase and levels and mib > levels[-1] and self._may_set_aside(step, cfg):
            self.set_aside += mib - levels[-1]  # the phase's rise: the training steps' memory is unchanged
            self.last_set_aside = step
            mib = levels[-1]
        if levels:
            change = mib - levels[-1]
            # A CUSUM at zero stays there on a change that is no rise (about half the changes of a noisy
            # series, every one of a flat one): the scale, the costliest part, is measured only if it counts.
            if self.seen >= cfg.min_points and (change > 0 or self.cusum > 0):
                self._advance(step, change, measured, cfg)  # (the scale's floor: of the measured level)
            self._remember_change(abs(change))
        if self.onset is not None:
            if len(self.episode) == self.episode.maxlen:  # the fit lets its oldest sample go
                self.level_to_beat = max(self.level_to_beat, self.episode[0][1])
            self.episode.append((t, mib))
            self.episode_steps += 1
        self.history.append((step, t, mib))
        levels.append(mib)
        self.seen += 1
        self.last_step = step
        return self.onset is not None

    def _may_set_aside(self, step: int, cfg: MemoryConfig) -> bool:
        """At most one step in ``min_steps``: a run that evaluates every step still has its growth seen."""
        return self.last_set_aside is None or step - self.last_set_aside >= cfg.min_steps

    def _advance(self, step: int, change: float, mib: float, cfg: MemoryConfig) -> None:
        """The CUSUM's step for a ``change`` to ``mib``; the episode starts when it leaves zero and ends
        when it is back."""
        before = self.cusum
        score = max(-_CLIP, min(_CLIP, change / self.scale(mib)))
        self.cusum = min(_CAP * cfg.threshold, max(0.0, before + score - cfg.allowance))
        if self.cusum <= 0:
            self.onset = None
        elif before <= 0:
            self.onset = step
            self.level_to_beat = max(self.levels)
            self.episode.clear()
            self.episode_steps = 0

    def _remember_change(self, size: float) -> None:
        changes, ordered = self.changes, self.sorted_changes
        if len(changes) < cast(int, changes.maxlen):
            changes.append(size)
            bisect.insort(ordered, size)
            return
        oldest = changes[0]
        changes.append(size)  # (the deque lets the oldest go)
        if size != oldest:  # the same size in as out (a flat series' zeros) leaves the sorted list as it is
            del ordered[bisect.bisect_left(ordered, oldest)]
            bisect.insort(ordered, size)

    def growing(self, cfg: MemoryConfig) -> bool:
        """The cheap part of the test: the CUSUM at its threshold, for long enough."""
        return self.onset is not None and self.cusum >= cfg.threshold and self.episode_steps >= cfg.min_steps

    def growth_since(self, step: int) -> float:
        """Fitted growth (MiB) over this series' samples from ``step`` on (0 with fewer than three)."""
        samples = [(t, v) for s, t, v in self.history if s >= step]
        slope, _, _ = _fit(samples)
        return slope * (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0.0


class MemoryGrowthDetector(Detector):
    """Leak versus fragmentation, with the projected time to the memory limit (see the module doc)."""

    name = NAME

    def __init__(self, config: MemoryConfig):
        self.config = config
        self._t0: datetime | None = None
        self._series: dict[str, _Series] = {}
        self._phase = False  # an eval or a checkpoint since the last memory sample

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.setdefault("_phase", False)  # (a snapshot from before the phases were seen)
        self.__dict__.update(state)
        if "_series" not in state:  # a snapshot from before the sequential test: its fits are dropped
            self.__dict__.pop("_trends", None)
            self._series = {}
            self.config = MemoryConfig(**self.config.__dict__)  # its config lacks the test's knobs

    def _state(self, metric: str) -> _Series:
        series = self._series.get(metric)
        if series is None:
            series = self._series[metric] = _Series(self.config.window)
        return series

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            if isinstance(event, EvalEvent | CheckpointEvent) or (
                isinstance(event, HeartbeatEvent) and event.phase in _PHASES
            ):
                self._phase = True
            return []
        if event.memory is None:
            return []
        mem = event.memory
        phase, self._phase = self._phase, False
        if self._t0 is None:
            self._t0 = event.ts
        t = (event.ts - self._t0).total_seconds()
        found: list[Finding] = []
        step = event.step
        # Each series is fed first, and judged (the costly part, with many arguments) only while it grows.
        if mem.allocated is not None:
            if self._feed("allocated", mem.allocated, t, step, phase):
                used = mem.reserved or mem.allocated
                # (arguments: metric, value, event, used, limit, base, kind, found)
                self._judge(
                    "allocated", mem.allocated, event, used, mem.device_total, mem.allocated, "leak", found
                )
            if mem.reserved is not None and self._feed(
                "fragmentation", mem.reserved - mem.allocated, t, step, phase
            ):
                self._judge(
                    "fragmentation",
                    mem.reserved - mem.allocated,
                    event,
                    mem.reserved,
                    mem.device_total,
                    mem.reserved,
                    "fragmentation",
                    found,
                )
        if mem.host_rss is not None and self._feed("host_rss", mem.host_rss, t, step, phase):
            used = mem.cgroup_usage or mem.host_rss
            self._judge("host_rss", mem.host_rss, event, used, mem.cgroup_limit, mem.host_rss, "leak", found)
        return found

    def _feed(self, metric: str, value: int, t: float, step: int, phase: bool) -> bool:
        """Feed one sample to its series; whether the series is growing (a finding's test is due)."""
        series = self._series.get(metric)
        if series is None:
            series = self._state(metric)
        if step <= series.last_step:
            return False  # a replayed or rolled-back step: the series would fold back on itself
        cfg = self.config
        return series.observe(step, t, value / _MIB, cfg, phase) and series.growing(cfg)

    def _judge(
        self,
        metric: str,
        value: int,
        event: StepEvent,
        used: int,
        limit: int | None,
        base: int,
        kind: str,
        found: list[Finding],
    ) -> None:
        """The growing series' full test; append a finding if due."""
        series = self._series[metric]
        cfg = self.config
        samples = list(series.episode)
        if not _ongoing([v for _, v in samples], series.level_to_beat):
            return
        slope_mib, r2, _ = _fit(samples)
        if slope_mib <= 0 or r2 < cfg.min_r2:
            return
        newest, _, _ = _fit(samples[-max(3, len(samples) // 4) :])
        if newest < slope_mib / 4:
            return  # the growth has levelled off (a ramp to a new batch size's level): not a leak
        growth = slope_mib * (samples[-1][0] - samples[0][0]) * _MIB
        if kind == "fragmentation" and self._allocated_grows(series, growth):
            return
        # Project with the newer half's rate where it is clearly the faster (by two standard errors):
        # growth that speeds up must not look further from the limit than it is, and noise must not
        # make it look nearer.
        recent, _, error = _fit(samples[len(samples) // 2 :])
        rate = max(slope_mib, recent - 2 * error) * _MIB
        severity, seconds_to_limit = self._severity(rate, growth / max(base, 1), used, limit)
        if severity is None:
            return
        rank = _SEVERITY[severity]
        if series.cooldown.active(event.step) and rank <= series.last_severity:
            return
        series.last_severity = rank
        series.cooldown.start(event.step, cfg.cooldown_steps)
        found.append(
            self._finding(
                metric, kind, severity, event, value, series, rate, growth, base, r2, limit, seconds_to_limit
            )
        )

    def _allocated_grows(self, fragmentation: _Series, growth: float) -> bool:
        """Allocated grows too over the fragmentation's episode: that is the leak finding's."""
        allocated = self._state("allocated")
        assert fragmentation.onset is not None  # (growing() says so)
        return allocated.growth_since(fragmentation.onset) * _MIB > growth / 4

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
        series: _Series,
        slope: float,
        growth: float,
        base: int,
        r2: float,
        limit: int | None,
        seconds_to_limit: float | None,
    ) -> Finding:
        steps = len(series.episode)
        what = {
            "allocated": "CUDA allocated memory",
            "fragmentation": "CUDA reserved-but-unallocated memory",
            "host_rss": "host RSS",
        }[metric]
        cause = "a leak" if kind == "leak" else "fragmentation (allocated stays flat)"
        message = (
            f"{what} grows steadily, {cause}: +{_bytes(growth)} over the last {steps} steps, growing since "
            f"step {series.onset} ({growth / max(base, 1):.1%} of {_bytes(base)}, {_bytes(slope)}/s, "
            f"r² {r2:.2f})"
        )
        if seconds_to_limit is not None and limit is not None:  # (there is a time to the limit only with one)
            message += f"; at this rate the {_bytes(limit)} limit is reached in {_duration(seconds_to_limit)}"
        else:
            message += "; no memory limit is known"
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
                "steps_growing": series.episode_steps,
                "cusum": series.cusum,
                "level_to_beat_bytes": series.level_to_beat * _MIB,  # (of the training steps' memory)
                "set_aside_bytes": series.set_aside * _MIB,  # risen across evals and checkpoints
                "seconds_to_limit": seconds_to_limit,
                "limit_bytes": limit,
                "onset_step": series.onset,
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
