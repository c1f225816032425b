"""A sustained level shift in step time (the run got slower), not a single slow step.

river ``ADWIN(clock=1)`` watches the step time as a robust z of log(step time) against
the rolling median / IQR (river ``RollingQuantile``'s numbers, from one sorted window:
``rolling_quantile.RollingQuantiles``), clipped to +-4: on that scale a
checkpoint step 5x slower counts as one bounded outlier, and ADWIN's bound (whose
variance-free term assumes values of order one) reacts within a few steps to a shift.
ADWIN only raises the question; the answer comes from medians. While a drift is pending,
the change point is the split of the recent steps that best separates two means
(least squares, on the clipped z), and a finding needs the median step time after it to
exceed the median before it by ``min_change`` (relative), by at least three robust
standard errors, over at least ``MIN_AFTER`` steps and ``min_duration_s`` seconds of event time.
Isolated slow steps move no median; noise does not pass the standard-error test; and a burst of
slow steps shorter than ``min_duration_s`` (a starved machine descheduling a run of 20 ms steps for
a second) is not a drift in throughput. The median test stays pending for ``PENDING_STEPS`` steps
and at least ``PENDING_DURATIONS`` times ``min_duration_s``, so a slowdown of short steps is
still judged once it has lasted long enough.

After a finding the history restarts from the new level, so one slowdown is one finding.

Heartbeats feed a ``HostLoadTracker`` (detectors/runwatch/detectors/host_load.py): a finding carries
``evidence["host_load"]`` (the host's load before the onset and since it, and whether it got
busier) and says so in its message. While heartbeats carry host load, a finding made before any
heartbeat has measured the slow steps waits for one (at most 2.5 heartbeat periods).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from pydantic import Field
from river import drift

from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.host_load import HostLoadAttributed, HostLoadTracker
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import RollingQuantiles
from runwatch.producer.wire.schema import StepEvent


class ThroughputConfig(Strict):
    """A sustained level shift in step time (a slower run), not a single slow step."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps before any finding")
    delta: float = Field(default=0.01, gt=0, lt=1, description="ADWIN confidence parameter")
    min_change: float = Field(
        default=0.3, gt=0, description="relative change of the mean step time that counts"
    )
    min_duration_s: float = Field(
        default=2.0, ge=0, description="seconds of event time the slower steps must span"
    )
    cooldown_steps: int = Field(default=100, ge=0)


NAME = "throughput_drift"
WINDOW = 100  # steps of history for the robust scale and the "before" median
SEGMENT = 200  # recent steps searched for the change point
MIN_BEFORE = 10
MIN_AFTER = 5
PENDING_STEPS = 40  # how long an ADWIN signal keeps the median test running
PENDING_DURATIONS = 3  # and at least this many min_duration_s of event time
CLIP_Z = 4.0
MIN_SCALE_LOG = 0.02  # a very steady step time still has 2% noise, as far as significance goes
IQR_TO_SIGMA = 1.349


class ThroughputDetector(HostLoadAttributed):
    name = NAME

    def __init__(self, config: ThroughputConfig):
        self.config = config
        self._history = RollingQuantiles(WINDOW)  # log step times
        self._adwin = drift.ADWIN(delta=config.delta, clock=1)  # type: ignore[no-untyped-call]  # river.drift.ADWIN is not annotated
        self._log_t: deque[float] = deque(maxlen=SEGMENT)
        self._z: deque[float] = deque(maxlen=SEGMENT)
        self._steps: deque[int] = deque(maxlen=SEGMENT)
        self._times: deque[float] = deque(maxlen=SEGMENT)  # event time, s since the epoch
        self.seen = 0
        self._pending_until = -1
        self._pending_until_ts = -math.inf
        self._cooldown = Cooldown()
        self.host_load = HostLoadTracker()

    def find(self, event: StepEvent) -> tuple[Finding, int | None] | None:
        finding = self._judge(event)
        return None if finding is None else (finding, finding.evidence["onset_step"])

    def _judge(self, event: StepEvent) -> Finding | None:
        t = event.step_time_s
        if t is None or not math.isfinite(t) or t <= 0:
            return None
        y = math.log(t)
        if self.seen >= MIN_BEFORE:
            q25, median, q75 = self._history.quartiles()
            scale = max((q75 - q25) / IQR_TO_SIGMA, MIN_SCALE_LOG)
            z = min(max((y - median) / scale, -CLIP_Z), CLIP_Z)
            self._adwin.update(z)  # type: ignore[no-untyped-call]  # river.ADWIN.update is not annotated
            if self._adwin.drift_detected:
                self._pending_until = event.step + PENDING_STEPS
                self._pending_until_ts = event.ts.timestamp() + PENDING_DURATIONS * self.config.min_duration_s
        else:
            z = 0.0
        self._history.update(y)
        self._log_t.append(y)
        self._z.append(z)
        self._steps.append(event.step)
        self._times.append(event.ts.timestamp())
        self.seen += 1
        pending = event.step <= self._pending_until or event.ts.timestamp() <= self._pending_until_ts
        if not pending or self.seen < self.config.warmup or self._cooldown.active(event.step):
            return None
        finding = self._test(event)
        if finding is None:
            return None
        self._cooldown.start(event.step, self.config.cooldown_steps)
        self._pending_until = -1
        self._pending_until_ts = -math.inf
        self._restart()
        return finding

    def _restart(self) -> None:
        """The new level is the reference from here on."""
        self._adwin = drift.ADWIN(delta=self.config.delta, clock=1)  # type: ignore[no-untyped-call]  # river.drift.ADWIN is not annotated
        self._log_t.clear()
        self._z.clear()
        self._steps.clear()
        self._times.clear()
        self.seen = 0

    def _test(self, event: StepEvent) -> Finding | None:
        z = np.fromiter(self._z, dtype=np.float64)
        n = len(z)
        if n < MIN_BEFORE + MIN_AFTER:
            return None
        c = np.cumsum(z)
        k = np.arange(MIN_BEFORE, n - MIN_AFTER + 1)  # split: k steps before, n - k after
        before_mean = c[k - 1] / k
        after_mean = (c[-1] - c[k - 1]) / (n - k)
        gain = np.where(after_mean > before_mean, k * (n - k) / n * (after_mean - before_mean) ** 2, -1.0)
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            return None
        split = int(k[best])
        y = np.fromiter(self._log_t, dtype=np.float64)
        before = y[max(0, split - WINDOW) : split]
        after = y[split:]
        q25, before_med, q75 = np.quantile(before, (0.25, 0.5, 0.75))
        after_med = float(np.median(after))
        shift = after_med - float(before_med)
        change = math.expm1(shift)
        scale = max(float(q75 - q25) / IQR_TO_SIGMA, MIN_SCALE_LOG)
        stderr = 1.2533 * scale * math.sqrt(1 / len(after) + 1 / len(before))  # of a difference of medians
        if change < self.config.min_change or shift < 3 * stderr:
            return None
        duration = self._times[-1] - self._times[split - 1]  # from the end of the last step before the onset
        if duration < self.config.min_duration_s:
            return None  # slower, but not for long enough yet
        before_s, after_s = math.exp(before_med), math.exp(after_med)
        onset = self._steps[split]
        return Finding(
            detector=NAME,
            metric="step_time_s",
            step=event.step,
            rank=event.rank,
            severity="warning",
            value=after_s,
            threshold=before_s * (1 + self.config.min_change),
            score=change,
            message=(
                f"step time rose from {before_s:.4g}s to {after_s:.4g}s (+{change:.0%}, throughput "
                f"x{before_s / after_s:.2f}) since about step {onset}, over {len(after)} steps"
            ),
            evidence={
                "before_s": before_s,
                "after_s": after_s,
                "change": change,
                "onset_step": onset,
                "steps_after": len(after),
                "duration_s": duration,
                "robust_scale_log": scale,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=ThroughputConfig,
        build=lambda d: ThroughputDetector(d.throughput_drift),
        view="rank",
        knob="min_change",
        summary="a sustained level shift in step time (a slower run), with the host's load as evidence",
    )
)
