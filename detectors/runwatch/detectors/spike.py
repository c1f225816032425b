"""Upward spikes in a positive, heavy-tailed metric (loss, grad norm).

Robust z of log(value) against a rolling median and IQR (river ``RollingQuantile``'s numbers,
from one sorted window: ``rolling_quantile.RollingQuantiles``),
which tolerates the heavy tails of grad norms far better than a mean/std scorer.
A finding needs both the z threshold and a minimum ratio to the median, so a very
flat series does not turn noise into alarms.

Transient or diverging. A spike is a ``warning`` (critical only when it is huge: ``critical_z``
and ``critical_ratio`` both reached). The detector then watches the next ``divergence_steps``
values: if their median stays ``divergence_ratio`` times the pre-spike median or more (and half
the z threshold above it), the series did not come back and a second, ``critical`` finding with
``evidence.kind = "divergence"`` names the spike's step as its onset. Transient spikes recover on
their own within a few steps (OLMo-core skips such steps rather than act), so the default policy
alerts on the spike and rolls back only the divergence.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime
from typing import Any

from pydantic import Field, model_validator

from runwatch.contract.schema import RankExtreme, Severity, StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.rank_outlier import RankOutlier, RankOutlierTest
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA, RollingQuantiles


class SpikeConfig(Strict):
    enabled: bool = True
    window: int = Field(default=100, ge=8, description="steps of history for the rolling median / IQR")
    warmup: int = Field(default=20, ge=4, description="steps observed before any finding")
    z_threshold: float = Field(default=6.0, gt=0, description="robust z of log(value) that counts as a spike")
    critical_z: float = Field(
        default=12.0, gt=0, description="robust z above which the spike is critical ..."
    )
    critical_ratio: float = Field(
        default=10.0,
        ge=1.0,
        description="... and value / rolling median reaches this (the default policy rolls back)",
    )
    min_ratio: float = Field(default=2.0, ge=1.0, description="value / rolling median must also reach this")
    divergence_steps: int = Field(
        default=5,
        ge=0,
        description="steps after a spike watched for a divergence (0: no divergence findings)",
    )
    divergence_ratio: float = Field(
        default=1.5,
        gt=1.0,
        description="median of those steps / the pre-spike median at least this: diverging, "
        "a critical finding (else the spike was transient)",
    )
    min_scale: float = Field(
        default=0.05,
        gt=0,
        description="floor on the robust scale in log units (a very flat series is not a hair trigger)",
    )
    cooldown_steps: int = Field(default=5, ge=0, description="steps after a finding before the next one")

    @model_validator(mode="after")
    def _warmup_fits(self) -> SpikeConfig:
        if self.warmup > self.window:
            raise ValueError(f"warmup ({self.warmup}) must not exceed window ({self.window})")
        if self.critical_z < self.z_threshold:
            raise ValueError("critical_z must be at least z_threshold")
        return self


class SpikeDetector:
    """One metric's spike test, the core that :class:`StepSpike` (the registered detector) runs per
    metric; not a :class:`~runwatch.detectors.base.Detector` itself."""

    def __init__(self, name: str, metric: str, config: SpikeConfig):
        self.name = name
        self.metric = metric
        self.config = config
        self._history = RollingQuantiles(config.window)  # log values
        self.seen = 0
        self._cooldown = Cooldown()
        self._watch: _DivergenceWatch | None = None  # the latest spike, while its next steps are watched

    def update(
        self, value: float | None, step: int, rank: int | None = None, skipped: bool = False
    ) -> Finding | None:
        """``skipped``: the trainer's guard skipped this step's update (the weights never saw it): a spike
        is said at ``info`` (recorded, no alert, no rollback), neither learnt nor watched for a divergence."""
        if value is None or not math.isfinite(value) or value <= 0:
            return None  # non-finite values belong to the non-finite detector
        x = math.log(value)
        if skipped:
            return self._skipped_spike(x, value, step, rank)
        # (the watch after a spike is rare: no call on every other step)
        finding = self._follow_spike(x, step, rank) if self._watch is not None else None
        if finding is None and self.seen >= self.config.warmup and not self._cooldown.active(step):
            finding = self._score(x, value, step, rank)
            if finding is not None and self.config.divergence_steps > 0:
                median = self._history.get(0.5)
                assert median is not None  # past warm-up
                self._watch = _DivergenceWatch(step, median, finding.evidence["robust_scale_log"])
        self._history.update(x)
        self.seen += 1
        if finding is not None:
            self._cooldown.start(step, self.config.cooldown_steps)
        return finding

    def _skipped_spike(self, x: float, value: float, step: int, rank: int | None) -> Finding | None:
        if self.seen < self.config.warmup or self._cooldown.active(step):
            return None
        finding = self._score(x, value, step, rank)
        if finding is None:
            return None
        self._cooldown.start(step, self.config.cooldown_steps)
        return replace(
            finding,
            severity="info",
            message=finding.message + "; the trainer's guard skipped its update",
            evidence={**finding.evidence, "update_skipped": True},
        )

    def _follow_spike(self, x: float, step: int, rank: int | None) -> Finding | None:
        """After a spike: a divergence finding once ``divergence_steps`` more values stayed high."""
        watch = self._watch
        if watch is None:
            return None
        if step <= watch.spike_step:  # replayed from before the spike (a rollback): it no longer applies
            self._watch = None
            return None
        watch.values.append(x)
        if len(watch.values) < self.config.divergence_steps:
            return None
        self._watch = None
        after = sorted(watch.values)[len(watch.values) // 2]
        ratio = math.exp(after - watch.median)
        z = (after - watch.median) / watch.scale
        if ratio < self.config.divergence_ratio or z < self.config.z_threshold / 2:
            return None  # came back: the spike was transient
        typical = math.exp(watch.median)
        return Finding(
            detector=self.name,
            metric=self.metric,
            step=step,
            rank=rank,
            severity="critical",
            value=math.exp(after),
            threshold=typical * self.config.divergence_ratio,
            score=z,
            message=(
                f"{self.metric} did not come back after its spike at step {watch.spike_step}: the median of "
                f"the {len(watch.values)} steps since is {math.exp(after):.4g}, {ratio:.1f}x the pre-spike "
                f"median {typical:.4g} (diverging)"
            ),
            evidence={
                "kind": "divergence",
                "onset_step": watch.spike_step,
                "pre_spike_median": typical,
                "median_since": math.exp(after),
                "ratio": ratio,
                "steps_watched": len(watch.values),
            },
        )

    def _score(self, x: float, value: float, step: int, rank: int | None) -> Finding | None:
        median = self._history.median()  # (scored only past warm-up: the window is not empty)
        ratio = math.exp(x - median)
        if ratio < self.config.min_ratio:
            return None  # (the usual case: no need for the quartiles)
        q25, _, q75 = self._history.quartiles()
        scale = max((q75 - q25) / IQR_TO_SIGMA, self.config.min_scale)
        z = (x - median) / scale
        if z < self.config.z_threshold:
            return None
        typical = math.exp(median)
        return Finding(
            detector=self.name,
            metric=self.metric,
            step=step,
            rank=rank,
            severity="critical"
            if z >= self.config.critical_z and ratio >= self.config.critical_ratio
            else "warning",
            value=value,
            threshold=typical * math.exp(self.config.z_threshold * scale),
            score=z,
            message=(
                f"{self.metric} spiked to {value:.4g}, {ratio:.1f}x "
                f"its rolling median {typical:.4g} (robust z {z:.1f})"
            ),
            evidence={
                "kind": "spike",
                "rolling_median": typical,
                "ratio": ratio,
                "robust_scale_log": scale,
                "window": self.config.window,
            },
        )


class _DivergenceWatch:
    """The values (log) after a spike, against the median (log) and scale before it."""

    def __init__(self, spike_step: int, median: float, scale: float):
        self.spike_step = spike_step
        self.median = median
        self.scale = scale
        self.values: list[float] = []


class StepSpike(Detector):
    """The detector contract around :class:`SpikeDetector`, on one scalar field of step events.

    On a joined step of several ranks (``rank_extremes``, issue 38) a second test judges the rank with the
    largest figure against the other ranks (rank_outlier.py): the ratio of its figure to theirs, against
    that ratio's own history (ranks on different data differ by a steady amount), on two steps in a row. A
    spike of one rank is then found and named even where the joined mean hides it (one rank of 64 at 20x
    moves the mean by 30%), a spike every rank shares leaves the ratio alone, and a step either test flags
    is one finding, naming the rank when the rank test made it."""

    def __init__(self, name: str, metric: str, config: SpikeConfig):
        self.name = name
        self.metric = metric
        self._detector = SpikeDetector(name, metric, config)
        self._ranks: RankOutlierTest | None = None  # made at the first joined step of several ranks

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            return []
        skipped = event.update_skipped is not None
        finding = self._detector.update(getattr(event, self.metric), event.step, event.rank, skipped)
        extreme = event.rank_extremes.get(self.metric) if event.rank_extremes else None
        if extreme is not None and extreme.others > 0 and math.isfinite(extreme.value):
            ratio = extreme.value / extreme.others
            outlier = self._rank_test().update(ratio, event.step, extreme.rank)
            if outlier is not None:
                finding = self._one_rank(event.step, outlier, finding, extreme, skipped)
            elif finding is not None and ratio >= self._detector.config.min_ratio:
                # the joined step's spike, with the rank that stands out in it (not yet a verdict on the rank:
                # that takes a second step)
                finding = replace(
                    finding,
                    message=f"{finding.message}; largest on rank {extreme.rank}, {ratio:.1f}x the others'",
                    evidence={
                        **finding.evidence,
                        "largest_rank": extreme.rank,
                        "largest_ratio_to_others": ratio,
                    },
                )
        return [finding] if finding is not None else []

    def _rank_test(self) -> RankOutlierTest:
        test = getattr(self, "_ranks", None)  # (None too in a snapshot from before issue 38)
        if test is None:
            c = self._detector.config
            test = self._ranks = RankOutlierTest(
                c.window, c.warmup, c.z_threshold, c.min_ratio, c.min_scale, c.cooldown_steps
            )
        return test

    def _one_rank(
        self, step: int, outlier: RankOutlier, joined: Finding | None, extreme: RankExtreme, skipped: bool
    ) -> Finding:
        """The step's one finding, naming the rank: critical when every step of the streak was huge (or
        the joined test's finding is); ``info`` when the guard skipped the update."""
        c = self._detector.config
        huge = all(z >= c.critical_z and r >= c.critical_ratio for z, r in outlier.scores)
        severity: Severity = (
            "critical" if huge or (joined is not None and joined.severity == "critical") else "warning"
        )
        if skipped:
            severity = "info"
        rank, others = outlier.rank, extreme.others
        ratio = extreme.value / others
        z = min(score for score, _ in outlier.scores)
        evidence: dict[str, Any] = {
            "kind": "rank_spike",
            "rank": rank,
            "onset_step": outlier.first_step,
            "steps": len(outlier.scores),
            "others": others,
            "ranks": extreme.ranks,
            "ratio_to_others": ratio,
            "usual_ratio_to_others": outlier.usual,
            "robust_scale_log": outlier.scale,
        }
        if joined is not None:
            evidence["joined"] = {"value": joined.value, "message": joined.message}
        peers = "mean" if self.metric == "loss" else "root mean square"
        return Finding(
            detector=self.name,
            metric=self.metric,
            step=step,
            rank=rank,
            severity=severity,
            value=extreme.value,
            threshold=others * outlier.usual * math.exp(c.z_threshold * outlier.scale),
            score=z,
            message=(
                f"{self.metric} spiked on rank {rank} since step {outlier.first_step} ({len(outlier.scores)} "
                f"steps): {extreme.value:.4g}, {ratio:.1f}x the other {extreme.ranks - 1} ranks' {peers} "
                f"{others:.4g} (usually {outlier.usual:.2f}x; robust z {z:.1f})"
                + ("; the trainer's guard skipped its update" if skipped else "")
            ),
            evidence=evidence,
        )


register(
    DetectorSpec(
        name="loss_spike",
        config=SpikeConfig,
        build=lambda d: StepSpike("loss_spike", "loss", d.loss_spike),
        view="joined",
        knob="z_threshold",
        summary=(
            "a loss spike (warning), critical when it does not come back within divergence_steps or is huge"
        ),
    )
)
register(
    DetectorSpec(
        name="grad_norm_spike",
        config=SpikeConfig,
        build=lambda d: StepSpike("grad_norm_spike", "grad_norm", d.grad_norm_spike),
        view="joined",
        knob="z_threshold",
        # grad norms are heavier-tailed than losses (an LR warm-up peak doubles them): a spike needs 3x
        default=lambda: SpikeConfig(min_ratio=3.0),
        summary="a gradient-norm spike (before clipping), critical as the loss spike is",
    )
)
