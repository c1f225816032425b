"""A sustained level shift in step time (the run got slower), not a single slow step.

**The question: a sequential test.** Each step time becomes a robust z of log(step time) against the
run's own level: the rolling median / IQR of the last ``WINDOW`` steps (river ``RollingQuantile``'s
numbers, from one sorted window: ``rolling_quantile.RollingQuantiles``), clipped to +-4, so that a
checkpoint step 5x slower counts as one bounded outlier. A one-sided CUSUM sums the z's above a slack of
``CUSUM_SLACK`` robust standard deviations (``S = max(0, S + z - slack)``, capped at ``CUSUM_CAP`` times the
threshold); while ``S`` is at ``cusum_threshold`` the evidence that the run is slower than its own level has
piled up, be it a jump (a few steps at +4) or a creep (many steps a little above), and the answer below is
sought at every step.

**The onset.** Where the CUSUM last left zero (Page's estimate), unless the z's since then are better
fitted by a jump at a later step than by a straight rise from there (``onset_of_rise``): a creep is timed
from where it began, not from its middle, and a jump shortly after one slow step from the jump.

**The answer: medians.** Against the median of the (up to ``WINDOW``) steps before the onset, a finding
needs:

- the median since the onset higher by at least three robust standard errors (slower, for sure);
- the median of the latest steps higher by ``min_change`` (relative) and by three robust standard errors
  (slower by that much now: a creep is found once it has crept far enough, not once its average has).
  The window adapts to the step interval and to the noise: ``MIN_RECENT`` steps, or as many as span
  ``min_duration_s``, or as many as measure the new level to ``MAX_LEVEL_SE`` (10%), whichever is most;
- the slower steps spanning at least ``min_duration_s`` of event time, over at least ``MIN_AFTER`` steps.

Isolated slow steps move no median; noise does not pass the standard-error tests; and a burst of slow steps
shorter than ``min_duration_s`` (a starved machine descheduling a run of 20 ms steps for a second) is not a
drift in throughput. After a finding the history restarts from the new level, so one slowdown is one finding
(a creep that goes on is found again once it has crept by ``min_change`` more, after ``cooldown_steps``).

**Contention named, not blamed.** Heartbeats feed a ``HostLoadTracker`` (detectors/runwatch/detectors/
host_load.py): a finding carries ``evidence["host_load"]`` (the host before the onset and over the latest
steps it judged, whether it got busier, whether it was saturated) and says so in its message; while
heartbeats carry host load, a finding made before any heartbeat has measured the slow steps waits for one
(at most 2.5 heartbeat periods). Then ``host_load.contention`` asks whether the host explains the slowdown
(the CPU share the run lost went to waiting for a CPU or to steal; without the process's figures, the fair
share of the CPUs the load leaves it), and the finding says which in ``evidence["cause"]`` (the verdict in
``evidence["contention"]``):

- ``"run"``: the host does not explain it (leaves more than ``min_change`` unexplained): the run's own
  slowdown, a warning, also on a saturated host;
- ``"unknown"``: the host is saturated now and took some CPU time from the run (CPU wait, steal, load), but
  not enough to explain all of the slowdown: a warning whose message begins "cause unknown (host
  saturated): ", never blamed on the run (what is left may be the host's noise);
- ``"contention"`` on a host that was not saturated before the onset (a neighbour arrived): a warning whose
  message begins "contention: ";
- ``"contention"`` on a host saturated before and after the onset: severity ``info`` (no alarm; the default
  policy takes no action), "contention on a host saturated throughout, not the run's own slowdown: ...".
  Not the run's episode either: its cooldown is lifted, so a regression of the run's own right after is
  still found.

Without host load on the heartbeats (an older producer, a simulated clock without a simulated host) a
finding has no ``cause`` and stays a warning.

**GPU health** (gpu_health.py): where the rank's heartbeats carry ``gpu`` (NVML's figures), the finding
carries them as they are when it goes out (``evidence["gpu"]``: the latest sample, the throttle reasons
active and since when) and its message says so ("rank 2: thermal throttle since 12:04:11 (SM clock 1110 of
1980 MHz)"). Attribution only: it changes no verdict.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import replace
from datetime import datetime
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from runwatch.contract.schema import HeartbeatEvent, StepEvent, TelemetryEvent
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.gpu_health import GpuHealthTracker, attach
from runwatch.detectors.host_load import HostLoadAttributed, HostLoadTracker, contention, describe_contention
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA, RollingQuantiles

log = logging.getLogger(__name__)


class ThroughputConfig(Strict):
    """A sustained level shift in step time (a slower run), not a single slow step."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps before any finding")
    cusum_threshold: float = Field(
        default=12.0, gt=0, description="CUSUM of robust z's (above a 0.5 slack) that raises the question"
    )
    min_change: float = Field(
        default=0.3, gt=0, description="relative rise of the recent median step time that counts"
    )
    min_duration_s: float = Field(
        default=2.0, ge=0, description="seconds of event time the slower steps must span"
    )
    cooldown_steps: int = Field(default=100, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _drop_adwin_delta(cls, data: Any) -> Any:
        """``delta`` tuned the ADWIN test the CUSUM replaced (issue 27): a config that still sets it loads,
        with a warning, rather than being refused as an unknown key."""
        if isinstance(data, dict) and "delta" in data:
            log.warning(
                "runwatch: detectors.throughput_drift.delta no longer does anything (the ADWIN test it tuned "
                "is gone; cusum_threshold sets how soon a slowdown is questioned): remove it from the config"
            )
            data = {key: value for key, value in data.items() if key != "delta"}
        return data


NAME = "throughput_drift"
WINDOW = 100  # steps of history for the robust scale and the "before" median
SEGMENT = 200  # recent steps kept: the onset is looked for among them
MIN_BEFORE = 10
MIN_AFTER = 5
MIN_RECENT = 10  # steps of the "now" median, at least (more where they span less than min_duration_s)
CLIP_Z = 4.0
CUSUM_SLACK = 0.5  # robust standard deviations above the level that the CUSUM lets pass
CUSUM_CAP = 2.0  # times cusum_threshold: a long wait below min_change does not keep the test pending for ever
MIN_SCALE_LOG = 0.02  # a very steady step time still has 2% noise, as far as significance goes
MEDIAN_SE = 1.2533  # the standard error of a median, in standard deviations over sqrt(n)
SIGNIFICANCE = 3.0  # robust standard errors
MAX_LEVEL_SE = 0.1  # the standard error of the recent median (log): the new level known to about 10%


def onset_of_rise(z: np.ndarray, start: int) -> int:
    """Where the rise of the z's that the CUSUM has summed since ``start`` began. Two fits of
    ``z[start:]``: a jump at the split that explains most (the largest ``sum(z[k:]) ** 2 / (n - k)``;
    the steps before it at their own level, 0 or above), and a straight rise from 0 at ``start``; the
    jump's split unless the rise fits better (a creep, which began where the CUSUM left zero). A single
    slow step shortly before a jump keeps the CUSUM above zero for a while: the jump, not that step, is
    the onset."""
    n = len(z)
    k = np.arange(start, n)  # up to the latest step: a fresh jump is not split before its start
    tail = np.cumsum(z[::-1])[::-1]  # tail[i] = sum(z[i:])
    split = int(k[int(np.argmax(np.where(tail[k] > 0, tail[k] ** 2 / (n - k), -1.0)))])
    jumped, before = z[split:], z[start:split]
    # the steps before the jump at their own level (a busy host may have kept them a little slow, and the
    # CUSUM above zero): a 3x jump after them is still a jump, not the end of a creep that began with them
    level = max(0.0, float(before.mean())) if len(before) else 0.0
    jump_sse = float(np.sum((before - level) ** 2) + np.sum((jumped - jumped.mean()) ** 2))
    seg = z[start:]
    x = np.arange(1, len(seg) + 1, dtype=np.float64)
    slope = max(0.0, float(x @ seg) / float(x @ x))
    ramp_sse = float(np.sum((seg - slope * x) ** 2))
    return start if ramp_sse < jump_sse else split


def median_shift(before: np.ndarray, after: np.ndarray, scale: float) -> tuple[float, float]:
    """How much higher the median of ``after`` is than that of ``before`` (log), and its standard error."""
    shift = float(np.median(after)) - float(np.median(before))
    return shift, MEDIAN_SE * scale * math.sqrt(1 / len(after) + 1 / len(before))


class ThroughputDetector(HostLoadAttributed):
    name = NAME
    # (class defaults: a detector pickled before the CUSUM unpickles with none accumulated)
    _cusum = 0.0
    _rise_at: int | None = None  # where the CUSUM last left zero (counted in steps since the restart)
    gpu: GpuHealthTracker | None = None  # the rank's GPU health, once a heartbeat carries ``gpu``

    def __init__(self, config: ThroughputConfig):
        self.config = config
        self._history = RollingQuantiles(WINDOW)  # log step times
        self._cusum = 0.0
        self._rise_at = None
        self._log_t: deque[float] = deque(maxlen=SEGMENT)
        self._z: deque[float] = deque(maxlen=SEGMENT)
        self._steps: deque[int] = deque(maxlen=SEGMENT)
        self._times: deque[float] = deque(maxlen=SEGMENT)  # event time, s since the epoch
        self.seen = 0
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
        z = self._z_score(y) if self.seen >= MIN_BEFORE else 0.0
        pending = self._accumulate(z)
        self._history.update(y)
        self._log_t.append(y)
        self._z.append(z)
        self._steps.append(event.step)
        self._times.append(event.ts.timestamp())
        self.seen += 1
        if not pending or self.seen < self.config.warmup or self._cooldown.active(event.step):
            return None
        finding = self._test(event)
        if finding is None:
            return None
        self._cooldown.start(event.step, self.config.cooldown_steps)
        self._restart()
        return finding

    def _z_score(self, y: float) -> float:
        """``y`` against the run's own level, in robust standard deviations, clipped."""
        q25, median, q75 = self._history.quartiles()
        scale = max((q75 - q25) / IQR_TO_SIGMA, MIN_SCALE_LOG)
        return min(max((y - median) / scale, -CLIP_Z), CLIP_Z)

    def _accumulate(self, z: float) -> bool:
        """One step of the one-sided CUSUM (this step is number ``seen`` since the restart); whether it
        is at its threshold. Where it last left zero is the onset estimate (Page's)."""
        threshold = self.config.cusum_threshold
        rising = self._cusum > 0
        self._cusum = min(max(0.0, self._cusum + z - CUSUM_SLACK), CUSUM_CAP * threshold)
        if self._cusum == 0:
            self._rise_at = None
        elif not rising or self._rise_at is None:
            self._rise_at = self.seen
        return self._cusum >= threshold

    def _restart(self) -> None:
        """The new level is the reference from here on."""
        self._cusum = 0.0
        self._rise_at = None
        self._log_t.clear()
        self._z.clear()
        self._steps.clear()
        self._times.clear()
        self.seen = 0

    def _recent_count(self, after: int, scale: float) -> int:
        """How many of the latest steps measure the level now: ``MIN_RECENT``, or as many as span
        ``min_duration_s`` (the step before them ended that long before the latest), or as many as put
        the standard error of their median within ``MAX_LEVEL_SE`` at noise ``scale``: the most of these,
        at most the ``after`` steps since the onset."""
        times = np.fromiter(self._times, dtype=np.float64)
        ended_before = np.flatnonzero(times <= times[-1] - self.config.min_duration_s)
        spanning = len(times) - 1 - int(ended_before[-1]) if len(ended_before) else len(times)
        precise = math.ceil((MEDIAN_SE * scale / MAX_LEVEL_SE) ** 2)
        return min(after, max(MIN_RECENT, spanning, precise))

    def _onset_index(self) -> int | None:
        """The onset's index in the kept steps, at least ``MIN_BEFORE`` in (module doc); None until
        ``MIN_AFTER`` steps since it."""
        n = len(self._z)
        first_kept = self.seen - n  # the number, since the restart, of the oldest kept step
        rise = (self._rise_at if self._rise_at is not None else self.seen) - first_kept
        start = max(MIN_BEFORE, rise)
        if n - start < MIN_AFTER:
            return None
        split = onset_of_rise(np.fromiter(self._z, dtype=np.float64), start)
        return split if n - split >= MIN_AFTER else None

    def _test(self, event: StepEvent) -> Finding | None:
        split = self._onset_index()
        if split is None:
            return None
        y = np.fromiter(self._log_t, dtype=np.float64)
        before, after = y[max(0, split - WINDOW) : split], y[split:]
        q25, q75 = np.quantile(before, (0.25, 0.75))
        scale = max(float(q75 - q25) / IQR_TO_SIGMA, MIN_SCALE_LOG)
        recent = after[-self._recent_count(len(after), scale) :]
        shift, stderr = median_shift(before, after, scale)
        shift_now, stderr_now = median_shift(before, recent, scale)
        change = math.expm1(shift_now)
        if shift < SIGNIFICANCE * stderr or shift_now < SIGNIFICANCE * stderr_now:
            return None  # not clearly slower
        if MEDIAN_SE * scale / math.sqrt(len(recent)) > MAX_LEVEL_SE:
            return None  # the new level is not measured well enough yet (noisy steps: wait for more)
        if change < self.config.min_change:
            return None  # slower, but not by enough (yet)
        duration = self._times[-1] - self._times[split - 1]  # from the end of the last step before the onset
        if duration < self.config.min_duration_s:
            return None  # slower, but not for long enough yet
        before_s, after_s = math.exp(float(np.median(before))), math.exp(float(np.median(recent)))
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
                "steps_recent": len(recent),
                "recent_from_step": self._steps[len(self._steps) - len(recent)],
                "duration_s": duration,
                "robust_scale_log": scale,
                "cusum": self._cusum,
            },
        )

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, HeartbeatEvent) and event.gpu is not None:
            if self.gpu is None:
                self.gpu = GpuHealthTracker()
            self.gpu.observe(event)
        return super().update(event, now)

    def attributed(self, finding: Finding) -> Finding:
        """The finding, named as contention where the host explains the slowdown, with the rank's GPU
        health (module doc)."""
        named = self._contention(finding)
        if self.gpu is None or named.rank is None:
            return named
        return attach(named, self.gpu.evidence(named.rank))

    def _contention(self, finding: Finding) -> Finding:
        host = finding.evidence.get("host_load")
        slowdown = finding.evidence["after_s"] / finding.evidence["before_s"]
        verdict = contention(host, slowdown, self.config.min_change)
        if host is None or verdict is None:
            return finding
        evidence = {**finding.evidence, "contention": verdict, "cause": verdict["cause"]}
        explained = describe_contention(verdict, host) if verdict["factors"] else ""
        if verdict["cause"] == "run":
            return replace(finding, message=finding.message + explained, evidence=evidence)
        if verdict["cause"] == "unknown":  # a slowdown still (a warning), but not the run's to answer for
            return replace(
                finding,
                message="cause unknown (host saturated): " + finding.message + explained,
                evidence=evidence,
            )
        message = finding.message + explained
        if not (verdict["saturated_before"] and verdict["saturated_now"]):
            return replace(finding, message="contention: " + message, evidence=evidence)  # a neighbour came
        self._cooldown = Cooldown()  # not the run's own episode: a regression right after still counts
        return replace(
            finding,
            severity="info",
            message="contention on a host saturated throughout, not the run's own slowdown: " + message,
            evidence=evidence,
        )


register(
    DetectorSpec(
        name=NAME,
        config=ThroughputConfig,
        build=lambda d: ThroughputDetector(d.throughput_drift),
        view="rank",
        knob="min_change",
        summary="a sustained level shift in step time (a slower run, found by a CUSUM), named as "
        "contention where the host explains it",
    )
)
