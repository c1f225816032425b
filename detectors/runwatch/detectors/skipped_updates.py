"""Updates the trainer's step guard skipped (``StepEvent.update_skipped``, producer/…/instrument/guard.py).

The guard skips a step's update before it lands: a non-finite gradient, or a gradient norm far
outside its recent band. One skip is handled: an ``info`` finding records it (no alert, and no
checkpoint is refused for it: the weights never saw the update). ``rollback_after`` skips in a row
are a run the guard only holds still: a ``critical`` finding, which the default policy rolls back.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register

NAME = "skipped_updates"

_WHY = {"nonfinite": "a non-finite gradient", "grad_spike": "a gradient norm outside its recent band"}


class SkippedUpdatesConfig(Strict):
    enabled: bool = True
    rollback_after: int = Field(
        default=3,
        ge=1,
        description="updates skipped in a row by the trainer's guard before a rollback request",
    )


class SkippedUpdates(Detector):
    name = NAME

    def __init__(self, config: SkippedUpdatesConfig):
        self.config = config
        self.streak = 0
        self.onset_step: int | None = None

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            return []
        if event.update_skipped is None:
            self.streak, self.onset_step = 0, None
            return []
        self.streak += 1
        if self.streak == 1:
            self.onset_step = event.step
        limit = self.config.rollback_after
        if self.streak not in (1, limit):
            return []
        critical = self.streak >= limit
        why = _WHY.get(event.update_skipped, event.update_skipped)
        return [
            Finding(
                detector=NAME,
                metric="update_skipped",
                step=event.step,
                rank=event.rank,
                severity="critical" if critical else "info",
                value=event.grad_norm,
                threshold=float(limit),
                score=float(self.streak),
                message=(
                    f"the trainer's guard skipped {self.streak} update(s) in a row since step "
                    f"{self.onset_step} ({why})"
                    + (" - rollback requested" if critical else ": the weights never saw it")
                ),
                evidence={
                    "reason": event.update_skipped,
                    "consecutive": self.streak,
                    "onset_step": self.onset_step,
                },
            )
        ]


register(
    DetectorSpec(
        name=NAME,
        config=SkippedUpdatesConfig,
        build=lambda d: SkippedUpdates(d.skipped_updates),
        view="rank",
        faults=(),  # no corpus fault: the corpus records faults unguarded (scenarios/.../training.py)
        summary=(
            "updates the trainer's step guard skipped: info at the first, critical (a rollback request) "
            "after rollback_after in a row"
        ),
    )
)
