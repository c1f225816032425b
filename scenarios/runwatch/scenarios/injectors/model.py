"""Faults of the model's weights and units: a bad initialisation, frozen (or gradually unfrozen) modules,
dead units, growing activations."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

from runwatch.scenarios.injectors.base import FaultInjector, FaultRun


@dataclass
class BadInit(FaultInjector):
    """A mistake built into the model from step 0 (the randn mel scale): nothing is injected while
    training. Only a comparison with earlier runs of the job, its correctly initialised twin, shows it;
    ``module`` is the owner of the badly initialised parameter."""

    kind: ClassVar[str] = "bad_init"
    module: str

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "module": self.module}


@dataclass
class FrozenModules(FaultInjector):
    """At the onset the parameters of ``modules`` stop training (``requires_grad_(False)``, as a fine-tuning
    script that freezes a backbone at the wrong step does): their gradients are gone, the Watcher reports
    0.0 for them, the rest of the model trains on. ``unfreeze_at`` (a fraction of the run; healthy twins):
    they are frozen from step 0 and unfrozen there instead (gradual unfreezing, by design)."""

    kind: ClassVar[str] = "frozen_modules"
    modules: tuple[str, ...]
    unfreeze_at: float | None = None

    def describe(self) -> dict[str, Any]:
        module = self.modules[0] if self.unfreeze_at is None else None
        return {**super().describe(), "module": module, "kind": "frozen" if module else None}

    def _set(self, trainable: bool) -> None:
        named = dict(self.run.model.named_modules())
        for name in self.modules:
            for p in named[name].parameters():
                p.requires_grad_(trainable)

    def start(self, run: FaultRun) -> None:
        super().start(run)
        if self.unfreeze_at is not None:
            self._set(False)

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.unfreeze_at is not None:
            if step == int(round(self.unfreeze_at * self.run.steps)):
                self._set(True)
        elif self.at_onset(step):
            self._set(False)


@dataclass
class GradualUnfreezing(FrozenModules):
    """Healthy: ``modules`` frozen from step 0 and unfrozen at ``unfreeze_at`` of the run, by design."""

    kind: ClassVar[str] = "healthy"


@dataclass
class DeadUnits(FaultInjector):
    """At the onset ``frac`` of ``layer``'s output units get a bias pushed far negative (a bad update, a
    corrupted checkpoint shard): the activation module after it (``module``) outputs exactly 0 for them
    from then on, and their gradient is 0, so they stay dead."""

    kind: ClassVar[str] = "activations"
    layer: str
    module: str
    frac: float = 0.9

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "module": self.module, "kind": "dead", "magnitude": self.frac}

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if not self.at_onset(step):
            return
        linear = dict(self.run.model.named_modules())[self.layer]
        bias = cast(torch.Tensor, linear.bias)
        units = torch.randperm(bias.numel(), generator=torch.Generator().manual_seed(self.run.seed))
        with torch.no_grad():
            bias[units[: math.ceil(self.frac * bias.numel())]] -= 1e3


@dataclass
class ActivationGrowth(FaultInjector):
    """From the onset ``module``'s output is multiplied by ``factor`` once more every step (a gain running
    away, a residual branch compounding): nothing in one step looks wrong."""

    kind: ClassVar[str] = "activations"
    module: str
    factor: float = 1.01

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "module": self.module, "kind": "growth", "magnitude": self.factor}

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self._scale = 1.0
        target = dict(run.model.named_modules())[self.module]
        # prepend: the watcher's own hook (registered before) sees the scaled output, as the next layer does
        target.register_forward_hook(lambda _m, _i, out: out * self._scale, prepend=True)

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.active(step):
            self._scale = self.factor ** (step - cast(int, self.run.onset) + 1)
