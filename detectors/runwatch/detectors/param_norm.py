"""The parameter norm turning down: a sustained fall of ``param_norm`` below its own recent level, where
it had not been falling like that before (weight decay far stronger than configured, a decay applied
twice, a scale bug in the optimizer). The loss rises only slowly then (under ``loss_rise``'s threshold)
and no single step looks wrong; the weights themselves say it.

``param_norm`` comes every ``update_every`` steps (an observation). An observation is *low* when it is
below the highest observation of the last ``window_steps`` steps by ``min_fall`` or more, and the norm
was not already falling at half that rate over the ``window_steps`` before those (a run whose norm
decays steadily from the start, by design, is at its own normal). ``patience`` low observations in a row
make one finding; the norm back up to within ``min_fall`` of its recent high re-arms it. Healthy runs
drift slowly (the norm grows fast early, then slower): the corpus's healthy runs never fall 0.5% below
their recent high (docs/detectors.md). A step counter going back (a rollback) restarts the history.
"""

from __future__ import annotations

import math
from collections import deque
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


class ParamNormConfig(Strict):
    """The parameter norm falling, sustained, below its own recent level (weight decay far too strong)."""

    enabled: bool = True
    window_steps: int = Field(
        default=40, ge=2, description="steps whose param_norm observations make the recent level"
    )
    min_fall: float = Field(
        default=0.02, gt=0, lt=1, description="fraction below the recent high that makes an observation low"
    )
    patience: int = Field(default=2, ge=1, description="consecutive low observations before a finding")


NAME = "param_norm_drift"


class ParamNormDetector(Detector):
    name = NAME

    def __init__(self, config: ParamNormConfig):
        self.config = config
        self._log_fall = -math.log1p(-config.min_fall)  # (positive) log units
        self._history: deque[tuple[int, float]] = deque()  # (step, log norm) over the last 2 windows
        self._streak = 0
        self._fired = False
        self._onset: int | None = None

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or event.param_norm is None:
            return []
        norm = event.param_norm
        if not math.isfinite(norm) or norm <= 0:
            return []
        x, step = math.log(norm), event.step
        history = self._history
        if history and step <= history[-1][0]:  # the run went back: start afresh
            history.clear()
            self._streak, self._fired, self._onset = 0, False, None
        w = self.config.window_steps
        while len(history) > 1 and history[1][0] <= step - 2 * w:  # keep one observation at or before 2w ago
            history.popleft()
        finding = None
        if history and history[0][0] <= step - 2 * w:
            recent = [p for p in history if p[0] >= step - w]
            before = [p for p in history if p[0] < step - w]
            if recent and before:
                high_step, high = max(recent, key=lambda p: p[1])
                was_falling = before[-1][1] - before[0][1] <= -self._log_fall / 2
                fall = high - x
                if fall >= self._log_fall and not was_falling:
                    if self._streak == 0:
                        self._onset = high_step + 1
                    self._streak += 1
                    if self._streak >= self.config.patience and not self._fired:
                        self._fired = True
                        finding = self._finding(event, norm, math.exp(high), high_step, before)
                elif fall < self._log_fall:
                    self._streak, self._fired, self._onset = 0, False, None
        history.append((step, x))
        return [finding] if finding is not None else []

    def _finding(
        self, event: StepEvent, norm: float, high: float, high_step: int, before: list[tuple[int, float]]
    ) -> Finding:
        fall = 1 - norm / high
        earlier = math.exp(before[-1][1] - before[0][1])
        return Finding(
            detector=NAME,
            metric="param_norm",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"parameter norm falling: {norm:.4g} is {fall:.1%} below its recent high {high:.4g} (step "
                f"{high_step}) for {self._streak} observations, after it had gone {earlier - 1:+.1%} over "
                f"steps {before[0][0]}-{before[-1][0]}; the weights are shrinking (weight "
                "decay far stronger than configured, or applied twice?)"
            ),
            value=norm,
            threshold=high * (1 - self.config.min_fall),
            score=fall,
            evidence={
                "kind": "falling",
                "cause": "weights_shrinking",
                "recent_high": high,
                "recent_high_step": high_step,
                "fall": fall,
                "consecutive": self._streak,
                "onset_step": self._onset,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=ParamNormConfig,
        build=lambda d: ParamNormDetector(d.param_norm_drift),
        view="joined",
        knob="min_fall",
        summary="the parameter norm falling, sustained, below its own recent level (weight decay too strong)",
    )
)
