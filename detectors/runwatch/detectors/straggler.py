"""A straggler: one rank consistently slower than its peers.

Scored like NVIDIA's straggler detector (nvidia-resiliency-ext): each rank's rolling median of
its own work per step, and ``score = fastest rank's median / this rank's median``; under
``score_threshold`` (0.75) for ``patience`` joined steps in a row, the rank is named.

What is timed matters. In lockstep training (DDP, FSDP) every rank's *step time* is the same:
the fast ranks wait inside the gradient synchronisation for the slowest. So the rank's work is
``compute_s`` (time from the step's start until the rank was ready to synchronise, measured by
the producer's DDP comm hook) where the rank reports it, else its step time (ranks that do not
synchronise every step, where step time does differ). The ranks are compared on each joined step
(its ``JoinedStep`` record, after every rank's step event). One finding per episode: a rank re-arms
when its score has been back over the threshold for ``patience`` joined steps.

GPU health (gpu_health.py): where the ranks' heartbeats carry ``gpu`` (NVML's figures), the finding carries
the named rank's (``evidence["gpu"]``: its latest sample, the throttle reasons active and since when) and its
message says so ("rank 2: thermal throttle since 12:04:11 (SM clock 1110 of 1980 MHz)").
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from pydantic import Field
from river import stats

from runwatch.contract.schema import HeartbeatEvent, JoinedStep, StepEvent, TelemetryEvent
from runwatch.detectors.base import CrossRankDetector
from runwatch.detectors.findings import Finding
from runwatch.detectors.gpu_health import GpuHealthTracker, attach
from runwatch.detectors.registry import DetectorSpec, Strict, register


class StragglerConfig(Strict):
    """One rank consistently slower than its peers (scored as NVIDIA's straggler detector does)."""

    enabled: bool = True
    score_threshold: float = Field(
        default=0.75,
        gt=0,
        lt=1,
        description="fastest rank's median step work / this rank's below this: a straggler",
    )
    window: int = Field(default=50, ge=4, description="steps in each rank's rolling median")
    min_steps: int = Field(default=10, ge=2, description="steps of a rank before it is scored")
    patience: int = Field(
        default=5, ge=1, description="joined steps in a row under the threshold before a finding"
    )
    min_gap_s: float = Field(
        default=0.005,
        ge=0,
        description="and this rank's median is at least this much slower (tiny steps are noisy)",
    )


NAME = "straggler"


class _RankTiming:
    def __init__(self, window: int):
        self.median = stats.RollingQuantile(q=0.5, window_size=window)
        self.count = 0
        self.metric = "step_time_s"
        self.streak = 0  # joined steps in a row under the threshold
        self.healthy = 0  # ... and over it
        self.fired = False


class StragglerDetector(CrossRankDetector):
    """Each rank's work times from its step events; the ranks are compared on each joined step."""

    name = NAME
    # Each rank's GPU health from its heartbeats (None until one carries ``gpu``; a class default: a detector
    # pickled before it reads None)
    gpu: dict[int, GpuHealthTracker] | None = None

    def __init__(self, config: StragglerConfig):
        self.config = config
        self.ranks: dict[int, _RankTiming] = {}

    def update(self, event: TelemetryEvent | JoinedStep, now: datetime) -> list[Finding]:
        if isinstance(event, JoinedStep):
            return self._compare(event.step)
        if isinstance(event, StepEvent):
            self._record(event)
        elif isinstance(event, HeartbeatEvent) and event.gpu is not None:
            trackers = self.gpu if self.gpu is not None else {}
            self.gpu = trackers
            tracker = trackers.get(event.rank)
            if tracker is None:
                tracker = trackers[event.rank] = GpuHealthTracker()
            tracker.observe(event)
        return []

    def gpu_evidence(self, rank: int) -> dict[str, Any] | None:
        """``evidence["gpu"]`` for ``rank`` (gpu_health.py); None where its heartbeats carry none."""
        tracker = self.gpu.get(rank) if self.gpu is not None else None
        return tracker.evidence(rank) if tracker is not None else None

    def _record(self, event: StepEvent) -> None:
        value, metric = event.compute_s, "compute_s"
        if value is None:
            value, metric = event.step_time_s, "step_time_s"
        if value is None or not math.isfinite(value):
            return
        timing = self.ranks.get(event.rank)
        if timing is None:
            timing = self.ranks[event.rank] = _RankTiming(self.config.window)
        timing.median.update(value)
        timing.count += 1
        timing.metric = metric

    def _medians(self) -> dict[int, float]:
        """Each scored rank's rolling median (a rank with ``min_steps`` values has one)."""
        return {
            r: m
            for r, t in self.ranks.items()
            if t.count >= self.config.min_steps and (m := t.median.get()) is not None
        }

    def scores(self) -> dict[int, float]:
        """Each scored rank's ``fastest median / its median`` (1.0 for the fastest)."""
        medians = self._medians()
        if len(medians) < 2:
            return {}
        fastest = min(medians.values())
        return {r: (fastest / m if m > 0 else 1.0) for r, m in medians.items()}

    def _compare(self, step: int) -> list[Finding]:
        cfg = self.config
        scores = self.scores()
        if not scores:
            return []
        medians = self._medians()
        fastest_rank = min(medians, key=medians.__getitem__)
        findings = []
        for rank, score in scores.items():
            timing = self.ranks[rank]
            slow = score < cfg.score_threshold and medians[rank] - medians[fastest_rank] >= cfg.min_gap_s
            if not slow:
                timing.streak = 0
                timing.healthy += 1
                # re-armed only after as long a recovery as the alert needed
                if timing.healthy >= cfg.patience:
                    timing.fired = False
                continue
            timing.healthy = 0
            timing.streak += 1
            if timing.streak < cfg.patience or timing.fired:
                continue
            timing.fired = True
            findings.append(
                Finding(
                    detector=NAME,
                    metric=timing.metric,
                    step=step,
                    rank=rank,
                    severity="warning",
                    message=(
                        f"rank {rank} is a straggler: median {timing.metric} {medians[rank]:.3g} s against "
                        f"{medians[fastest_rank]:.3g} s on the fastest rank {fastest_rank} (score "
                        f"{score:.2f} < {cfg.score_threshold:g} for {timing.streak} steps)"
                    ),
                    value=score,
                    threshold=cfg.score_threshold,
                    score=score,
                    evidence={
                        "median_s": medians[rank],
                        "fastest_rank": fastest_rank,
                        "fastest_median_s": medians[fastest_rank],
                        "timed": timing.metric,
                        "rank_medians_s": {str(r): m for r, m in sorted(medians.items())},
                    },
                )
            )
        return [attach(f, self.gpu_evidence(f.rank)) if f.rank is not None else f for f in findings]


register(
    DetectorSpec(
        name=NAME,
        config=StragglerConfig,
        build=lambda d: StragglerDetector(d.straggler),
        view="cross_rank",
        summary=(
            "one rank consistently slower than its peers (its own compute time, not the synchronised step)"
        ),
    )
)
