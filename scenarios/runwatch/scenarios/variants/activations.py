"""Issue 37 shapes seen in a module's outputs (``rw.watch(..., activations=True)``): 90% of one hidden
layer's units dead at once, and one module's output compounding x1.01 a step."""

from __future__ import annotations

from runwatch.scenarios.faults import ActivationGrowth, DeadUnits
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "dead_units_mlp",
        DeadUnits(layer="encoder.0", module="encoder.1"),
        "mlp",
        "At step 180 the bias of 90% of encoder.0's units is pushed 1000 below zero: encoder.1 (GELU) "
        "outputs exactly 0 for them from then on, and they get no gradient back. The activations "
        "detector must name encoder.1 (kind dead) within 5 steps.",
        onset=0.6,
        seed=81,
        quick_steps=300,
    ),
    Scenario(
        "activation_growth_mlp",
        ActivationGrowth(module="encoder.2"),
        "mlp",
        "From step 180 encoder.2's output is multiplied by 1.01 once more every step (1.8x after 60 "
        "steps). The activations detector must name encoder.2 (kind growth) within 60 steps.",
        onset=0.6,
        seed=82,
        quick_steps=300,
    ),
)
