"""Modules that stop training mid-run: their gradient norm goes to exactly 0.0 (``requires_grad_(False)``
at the wrong step, a detached branch, a hook zeroing the gradient) or they vanish from
``module_grad_norms``, while the rest of the model still has a gradient.

Per module: once it has had a positive gradient norm for ``warmup`` steps, ``patience`` steps in a row
at exactly 0.0 (or absent from an event that reports other modules) make one finding naming every
module that went quiet in that streak. A module that is 0.0 from the start (frozen by design) never
trained, so it is never judged, and one unfrozen later starts its warm-up then (gradual unfreezing). A
step whose every module is 0.0 is no module's fault (the whole update is gone: the update-ratio and
loss detectors' business) and breaks no streak. A module that has a gradient again re-arms itself.
"""

from __future__ import annotations

import math
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


class FrozenModulesConfig(Strict):
    """Modules whose gradient goes to exactly zero (or that vanish) mid-run while the rest trains."""

    enabled: bool = True
    warmup: int = Field(
        default=20, ge=1, description="steps with a positive gradient norm before a module is judged"
    )
    patience: int = Field(
        default=5, ge=1, description="consecutive steps at exactly 0.0 (or absent) before a finding"
    )


NAME = "frozen_modules"


class _Module:
    __slots__ = ("active_steps", "fired", "since", "zero_streak")

    def __init__(self) -> None:
        self.active_steps = 0  # steps with a positive norm since it last went quiet
        self.zero_streak = 0
        self.since: int | None = None  # the first step of the current zero streak
        self.fired = False


class FrozenModulesDetector(Detector):
    name = NAME

    # The usual step, every known module with a positive finite norm, leaves each module's state as it
    # was but for one more active step: while the steps stay so, they are counted once here
    # (``_steady_steps``) and added to every module's ``active_steps`` when a step is not (``_settle``).
    # ``_steady``: the module names, in order, of the step that began the count (None: no count).
    # (Class defaults: a detector pickled before them has no count waiting.)
    _steady: tuple[str, ...] | None = None
    _steady_steps = 0

    def __init__(self, config: FrozenModulesConfig):
        self.config = config
        self._modules: dict[str, _Module] = {}

    def __getstate__(self) -> dict[str, object]:
        self._settle()  # (a snapshot holds every module's own count)
        return self.__dict__

    def _settle(self) -> None:
        """Add the steady steps counted since ``_steady`` began to every module's ``active_steps``."""
        if self._steady_steps:
            for module in self._modules.values():
                module.active_steps += self._steady_steps
        self._steady, self._steady_steps = None, 0

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or not event.module_grad_norms:
            return []
        norms = event.module_grad_norms
        values = norms.values()
        # Every norm finite and positive: a finite sum has no NaN or infinity among its terms (an overflow
        # to infinity only sends the step the long way), and then min() compares numbers only.
        if self._steady is not None and 0.0 < min(values) and sum(values) < math.inf:
            if tuple(norms) == self._steady:
                self._steady_steps += 1
                return []
        self._settle()
        if not any(math.isfinite(v) and v > 0 for v in values):
            return []  # no module has a gradient: not one module's fault, and no evidence either way
        newly: list[tuple[str, _Module]] = []
        steady = True  # every module trained this step (and no module is known but absent)
        for name, value in norms.items():
            module = self._modules.get(name)
            if module is None:
                module = self._modules[name] = _Module()
            if not math.isfinite(value):
                steady = False
                continue  # the non-finite detector's
            if value > 0:
                module.active_steps += 1
                module.zero_streak, module.since, module.fired = 0, None, False
            else:
                steady = False
                if self._quiet(module, event.step):
                    newly.append((name, module))
        if len(self._modules) > len(norms):  # (every name of the event is among them by now)
            steady = False
            for name, module in self._modules.items():  # modules that vanished from the event
                if name not in norms and self._quiet(module, event.step):
                    newly.append((name, module))
        if not newly:
            if steady:  # every module as a positive step leaves it: the next such steps are counted
                self._steady = tuple(norms)
            return []
        for _, module in newly:
            module.fired = True
            module.active_steps = 0  # a module that comes back warms up again
        return [self._finding(event, newly, norms)]

    def _quiet(self, module: _Module, step: int) -> bool:
        """One more step without a gradient; True when that makes the module a finding now."""
        if module.active_steps < self.config.warmup or module.fired:
            return False
        if module.zero_streak == 0:
            module.since = step
        module.zero_streak += 1
        return module.zero_streak >= self.config.patience

    def _finding(
        self, event: StepEvent, newly: list[tuple[str, _Module]], norms: dict[str, float]
    ) -> Finding:
        names = [name for name, _ in newly]
        onset = min(m.since for _, m in newly if m.since is not None)
        gone = [n for n in names if n not in norms]
        zero = [n for n in names if n in norms]
        training = sorted(n for n, v in norms.items() if math.isfinite(v) and v > 0)
        what = []
        if zero:
            what.append(f"gradient norm exactly 0 for {', '.join(zero)}")
        if gone:
            what.append(f"no gradient norm reported any more for {', '.join(gone)}")
        return Finding(
            detector=NAME,
            metric=f"module_grad_norms.{names[0]}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"modules frozen: {'; '.join(what)} since step {onset} ({self.config.patience}+ steps), "
                f"after they trained; {len(training)} other module(s) still have a gradient "
                f"({', '.join(training[:5])}{'...' if len(training) > 5 else ''})"
            ),
            value=0.0,
            threshold=0.0,
            score=float(len(names)),
            evidence={
                "module": names[0],
                "modules": names,
                "absent": gone,
                "kind": "frozen",
                "consecutive": self.config.patience,
                "still_training": len(training),
                "onset_step": onset,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=FrozenModulesConfig,
        build=lambda d: FrozenModulesDetector(d.frozen_modules),
        view="joined",
        knob="patience",
        summary="modules whose gradient goes to exactly zero (or that vanish) mid-run while the rest trains",
    )
)
