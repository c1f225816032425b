"""Non-finite loss or gradients: the run is producing NaN/Inf.

A warning at the first non-finite step of a streak (so the finding lands on the
fault step itself), a critical finding once the streak reaches ``max_consecutive``
(the policy turns that into a rollback). Any finite step ends the streak.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding, is_finite
from runwatch.detectors.registry import DetectorSpec, Strict, register


class NonFiniteConfig(Strict):
    enabled: bool = True
    max_consecutive: int = Field(
        default=3, ge=1, description="non-finite steps in a row before the finding turns critical (rollback)"
    )


NAME = "non_finite"


class NonFiniteDetector:
    """The streak of non-finite steps, the core of :class:`NonFinite` (the registered detector); not a
    :class:`~runwatch.detectors.base.Detector` itself."""

    def __init__(self, config: NonFiniteConfig):
        self.config = config
        self.streak = 0
        self.onset_step: int | None = None

    def update(self, event: StepEvent) -> Finding | None:
        bad = []
        if event.loss is not None and not is_finite(event.loss):
            bad.append("loss")
        if event.grad_norm is not None and not is_finite(event.grad_norm):
            bad.append("grad_norm")
        if event.nonfinite_grads:
            bad.append("grads")
        if not bad:
            self.streak = 0
            self.onset_step = None
            return None
        self.streak += 1
        if self.streak == 1:
            self.onset_step = event.step
        limit = self.config.max_consecutive
        if self.streak not in (1, limit):
            return None
        critical = self.streak >= limit
        value = event.loss if "loss" in bad else event.grad_norm
        return Finding(
            detector=NAME,
            metric=bad[0],
            step=event.step,
            rank=event.rank,
            severity="critical" if critical else "warning",
            value=value,
            threshold=float(limit),
            score=float(self.streak),
            message=(
                f"non-finite {', '.join(bad)} for {self.streak} step(s) since step {self.onset_step}"
                + (" - rollback threshold reached" if critical else "")
            ),
            evidence={
                "fields": bad,
                "consecutive": self.streak,
                "onset_step": self.onset_step,
                "nonfinite_grads": event.nonfinite_grads,
            },
        )


class NonFinite(Detector):
    """The detector contract around :class:`NonFiniteDetector` (step events only)."""

    name = NAME

    def __init__(self, config: NonFiniteConfig):
        self._detector = NonFiniteDetector(config)

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            return []
        finding = self._detector.update(event)
        return [finding] if finding is not None else []


register(
    DetectorSpec(
        name=NAME,
        config=NonFiniteConfig,
        build=lambda d: NonFinite(d.non_finite),
        view="rank",
        summary=(
            "NaN/Inf in the loss, the grad norm or any gradient; "
            "critical after max_consecutive steps in a row"
        ),
    )
)
