"""The data loader's share of step time growing: the input pipeline is becoming the bottleneck.

Per step, share = data_wait_s / step_time_s (clipped to 0..1; the wait is part of the
step). A finding needs the mean share of the last ``window`` steps to reach ``min_share``
and to exceed the run's baseline by ``min_increase``. The baseline is the lowest windowed
mean seen so far (after warm-up): loader start-up at the beginning of the run leaves it
as the window slides on, and gradual growth cannot drag it up, as a rolling baseline
would. One finding per episode: it re-arms once the mean is back well under the threshold,
or after ``cooldown_steps`` if the share has grown by another ``min_increase`` over its
level since the onset.
Steps without data_wait_s (the loader is not instrumented) are ignored.

Heartbeats feed a ``HostLoadTracker`` (detectors/runwatch/detectors/host_load.py): a finding carries
``evidence["host_load"]`` (the host's load before the onset, or before the window when no onset
is named, and since it) and says whether the host got busier (a starved loader on a contended
host is a neighbour's doing, not the pipeline's). While heartbeats carry host load, a finding made
before any heartbeat has measured the slow steps waits for one (at most 2.5 heartbeat periods).
"""

from __future__ import annotations

import math
from collections import deque

from pydantic import Field

from runwatch.contract.schema import StepEvent
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.host_load import HostLoadAttributed, HostLoadTracker
from runwatch.detectors.registry import DetectorSpec, Strict, register


class DataWaitConfig(Strict):
    """The data loader's share of step time growing: the input pipeline is becoming the bottleneck."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps before any finding")
    window: int = Field(default=30, ge=4, description="steps in the recent mean of the share")
    min_share: float = Field(
        default=0.25, ge=0, le=1, description="recent data-wait share of step time must reach this"
    )
    min_increase: float = Field(
        default=0.15, ge=0, le=1, description="and exceed the run's baseline share by this"
    )
    cooldown_steps: int = Field(default=100, ge=0)


NAME = "data_wait"


class DataWaitDetector(HostLoadAttributed):
    name = NAME

    def __init__(self, config: DataWaitConfig):
        self.config = config
        # step, share, wait, time
        self._recent: deque[tuple[int, float, float, float]] = deque(maxlen=config.window)
        # the shares of _recent, for the per-step mean
        self._shares: deque[float] = deque(maxlen=config.window)
        self.seen = 0
        self.baseline: float | None = None
        self._reported: float | None = None  # mean share at the last finding of the current episode
        self._cooldown = Cooldown()
        self.host_load = HostLoadTracker()

    def find(self, event: StepEvent) -> tuple[Finding, int | None] | None:
        """A finding and its onset (for the host-load comparison: the window's start when none is named)."""
        wait, step_time = event.data_wait_s, event.step_time_s
        if wait is None or step_time is None or not (math.isfinite(wait) and math.isfinite(step_time)):
            return None
        if step_time <= 0 or wait < 0:
            return None
        share = min(wait / step_time, 1.0)
        self._recent.append((event.step, share, wait, step_time))
        self._shares.append(share)
        self.seen += 1
        cfg = self.config
        if self.seen < cfg.warmup or len(self._recent) < cfg.window:
            return None
        mean = sum(self._shares) / len(self._shares)  # the same additions in the same order as over _recent
        baseline = self.baseline
        self.baseline = mean if baseline is None else min(baseline, mean)
        if baseline is None:
            return None
        threshold = max(cfg.min_share, baseline + cfg.min_increase)
        if mean < threshold:
            if mean < threshold - cfg.min_increase / 2:
                self._reported = None  # episode over (with hysteresis, so noise at the edge is not a new one)
            return None
        if self._reported is not None and (
            self._cooldown.active(event.step) or mean < self._reported + cfg.min_increase
        ):
            return None
        finding, level = self._finding(event, mean, baseline, threshold)
        self._reported = level
        self._cooldown.start(event.step, cfg.cooldown_steps)
        return finding, finding.evidence.get("onset_step", self._recent[0][0])

    def _finding(
        self, event: StepEvent, mean: float, baseline: float, threshold: float
    ) -> tuple[Finding, float]:
        """The finding, and the share level since the onset (what a later escalation is measured against)."""
        n = len(self._recent)
        elevated = baseline + self.config.min_increase
        onset = next((s for s, share, _, _ in self._recent if share >= elevated), self._recent[0][0])
        since = [share for s, share, _, _ in self._recent if s >= onset]
        level = max(mean, sum(since) / len(since))
        wait = sum(r[2] for r in self._recent) / n
        step_time = sum(r[3] for r in self._recent) / n
        evidence = {
            "share": mean,
            "baseline_share": baseline,
            "increase": mean - baseline,
            "data_wait_s": wait,
            "step_time_s": step_time,
            "window": n,
        }
        recent = ""
        if onset < event.step:
            evidence["onset_step"] = onset
            evidence["share_since_onset"] = level
            recent = f", {level:.0%} since step {onset}"
        return Finding(
            detector=NAME,
            metric="data_wait_s",
            step=event.step,
            rank=event.rank,
            severity="warning",
            value=mean,
            threshold=threshold,
            score=mean - baseline,
            message=(
                f"the input pipeline is becoming the bottleneck: data-loader wait is {mean:.0%} of step time "
                f"over the last {n} steps ({wait:.3g}s of {step_time:.3g}s{recent}), up from a baseline of "
                f"{baseline:.0%}"
            ),
            evidence=evidence,
        ), level


register(
    DetectorSpec(
        name=NAME,
        config=DataWaitConfig,
        build=lambda d: DataWaitDetector(d.data_wait),
        view="rank",
        knob="min_increase",
        summary="the data loader's share of step time growing: the input pipeline is the bottleneck",
    )
)
