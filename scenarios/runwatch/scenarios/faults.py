"""Fault injectors: one class per fault kind, its mechanism chosen by explicit parameters.

A scenario's training loop (:mod:`.training` for the recorded scenarios, the demo's regressor loop)
calls every hook at a fixed point of each step; an injector changes only what its fault needs and
leaves the rest alone, so the loop itself never asks which fault it runs. The catalog holds one
configured injector per scenario; :meth:`FaultInjector.for_run` gives each run a fresh copy, whose
:meth:`~FaultInjector.start` binds it to that run (the onset step, the model, the clock).

The injectors live in ``injectors/``, one module per family (``base``: the hooks; ``gradients``,
``optimizer``, ``model``, ``data``, ``system``); every one is handed on here.
"""

from __future__ import annotations

from runwatch.scenarios.injectors.base import FaultInjector, FaultRun, Healthy
from runwatch.scenarios.injectors.data import (
    CategoryDivergence,
    CategoryLabelShuffle,
    Overfitting,
    ValidationLeak,
)
from runwatch.scenarios.injectors.gradients import GradNormSpike, LossSpike, ModuleGradExplosion, NonFinite
from runwatch.scenarios.injectors.model import (
    ActivationGrowth,
    BadInit,
    DeadUnits,
    FrozenModules,
    GradualUnfreezing,
)
from runwatch.scenarios.injectors.optimizer import LrRamp, OptimizerSwap, UpdateRatio, WeightDecayJump
from runwatch.scenarios.injectors.system import (
    DataWait,
    MemoryFragmentation,
    MemoryLeak,
    Stall,
    ThroughputDrift,
)

__all__ = [
    "ActivationGrowth",
    "BadInit",
    "CategoryDivergence",
    "CategoryLabelShuffle",
    "DataWait",
    "DeadUnits",
    "FaultInjector",
    "FaultRun",
    "FrozenModules",
    "GradNormSpike",
    "GradualUnfreezing",
    "Healthy",
    "LossSpike",
    "LrRamp",
    "MemoryFragmentation",
    "MemoryLeak",
    "ModuleGradExplosion",
    "NonFinite",
    "OptimizerSwap",
    "Overfitting",
    "Stall",
    "ThroughputDrift",
    "UpdateRatio",
    "ValidationLeak",
    "WeightDecayJump",
]
