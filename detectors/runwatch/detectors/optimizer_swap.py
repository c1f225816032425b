"""An optimizer the loop replaced without calling ``rw.watch`` again (issue 37): the watcher's step hooks
are on the old optimizer, so step events lose every gradient, weight and update figure and report the
old optimizer's LR, while training goes on unwatched.

Two ways to see it. A producer that knows says so: ``StepEvent.instrumentation ==
"optimizer_not_stepping"`` (the watched optimizer has not stepped for 3 steps while the model had
gradients). An older producer does not, but its telemetry shows it: step events that carried
``grad_norm`` for ``warmup`` steps stop carrying it for ``patience`` steps in a row while steps go on.
One ``warning`` per episode, naming the step the gradient figures stopped at; gradient figures that come
back (the new optimizer watched) re-arm it.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register

NAME = "optimizer_swap"
MARK = "optimizer_not_stepping"


class OptimizerSwapConfig(Strict):
    """Step events whose gradient figures stop mid-run: an optimizer replaced without ``rw.watch``."""

    enabled: bool = True
    warmup: int = Field(
        default=20, ge=1, description="steps that carried grad_norm before its absence is judged"
    )
    patience: int = Field(
        default=5, ge=1, description="steps in a row without grad_norm (older producers) before a finding"
    )


class OptimizerSwapDetector(Detector):
    name = NAME

    def __init__(self, config: OptimizerSwapConfig):
        self.config = config
        self.with_grad = 0  # steps that carried grad_norm since the last episode
        self.gap = 0  # steps in a row without grad_norm
        self.gap_since: int | None = None
        self.fired = False

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            return []
        marked = event.instrumentation == MARK
        if event.grad_norm is not None and not marked:
            self.with_grad += 1
            self.gap, self.gap_since, self.fired = 0, None, False
            return []
        if event.grad_norm is None:
            if self.gap == 0:
                self.gap_since = event.step
            self.gap += 1
        if self.fired:
            return []
        warmed = self.with_grad >= self.config.warmup
        if not (marked or (warmed and self.gap >= self.config.patience)):
            return []
        self.fired = True
        onset = self.gap_since if self.with_grad and self.gap_since is not None else event.step
        self.with_grad = 0
        return [self._finding(event, onset, marked)]

    def _finding(self, event: StepEvent, onset: int, marked: bool) -> Finding:
        how = (
            "the producer says the optimizer given to rw.watch no longer steps while the model has gradients"
            if marked
            else f"step events carried grad_norm, then none for {self.gap} steps in a row while steps go on"
        )
        return Finding(
            detector=NAME,
            metric="instrumentation" if marked else "grad_norm",
            step=event.step,
            rank=event.rank,
            severity="warning",
            value=None,
            threshold=float(self.config.patience),
            score=float(self.gap),
            message=(
                f"the optimizer swap since step {onset}: the loop most likely replaced its optimizer without "
                f"calling rw.watch(model, new_optimizer) ({how}); gradient, weight and update figures are "
                "gone and the LR reported is the old optimizer's"
            ),
            evidence={
                "kind": "optimizer_swap",
                "onset_step": onset,
                "source": "producer" if marked else "telemetry",
                "steps_without_grad": self.gap,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=OptimizerSwapConfig,
        build=lambda d: OptimizerSwapDetector(d.optimizer_swap),
        view="rank",
        knob="patience",
        summary=(
            "an optimizer replaced without rw.watch: step events marked optimizer_not_stepping, or "
            "grad_norm gone for patience steps after warmup steps with it"
        ),
    )
)
