"""Non-finite loss or gradients: the run is producing NaN/Inf.

A warning at the first non-finite step of a streak (so the finding lands on the
fault step itself), a critical finding once the streak reaches ``max_consecutive``
(the policy turns that into a rollback). Any finite step ends the streak.
"""

from __future__ import annotations

from runwatch.detectors.config import NonFiniteConfig
from runwatch.detectors.findings import Finding, is_finite
from runwatch.producer.schema import StepEvent

NAME = "non_finite"


class NonFiniteDetector:
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
            evidence={"fields": bad, "consecutive": self.streak, "onset_step": self.onset_step,
                      "nonfinite_grads": event.nonfinite_grads},
        )
