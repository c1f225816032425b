"""A detector from outside runwatch, for tests/detectors/test_registry.py: one module, one registration.

It finds a step whose loss is above a fixed ceiling (not a good detector; a short one)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict

NAME = "toy_loss_ceiling"


class ToyConfig(Strict):
    enabled: bool = True
    ceiling: float = Field(default=100.0, gt=0, description="a loss above this is a finding")


class ToyLossCeiling(Detector):
    name = NAME

    def __init__(self, config: ToyConfig):
        self.config = config

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or event.loss is None or not event.loss > self.config.ceiling:
            return []
        return [
            Finding(
                detector=NAME,
                metric="loss",
                step=event.step,
                rank=event.rank,
                severity="warning",
                value=event.loss,
                threshold=self.config.ceiling,
                message=f"loss {event.loss:g} above the ceiling {self.config.ceiling:g}",
            )
        ]


# runwatch registers it when it loads the entry point (pyproject.toml: runwatch.detectors)
SPEC = DetectorSpec(
    name=NAME,
    config=ToyConfig,
    build=lambda d: ToyLossCeiling(d.toy_loss_ceiling),
    view="rank",
    knob="ceiling",
    summary="a loss above a fixed ceiling (a test's toy)",
)
