"""Issue 37 shape: the loop replaces its AdamW mid-run without calling ``rw.watch`` again: gradient,
weight and update figures stop, the LR reported is the old optimizer's, and training goes on unwatched."""

from __future__ import annotations

from runwatch.scenarios.faults import OptimizerSwap
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "optimizer_swap_mlp",
        OptimizerSwap(),
        "mlp",
        "At step 120 the loop replaces its AdamW with a fresh one (same hyperparameters, the LR of the "
        "moment) and does not call rw.watch again: the step events lose grad_norm, the module, parameter "
        "and update norms, and keep reporting the old optimizer's LR; the producer marks them "
        "optimizer_not_stepping.",
        onset=0.4,
        seed=76,
        quick_steps=150,
    ),
)
