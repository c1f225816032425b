"""Issue 37 shapes: AdamW's weight decay x100 from some step (the weights shrink, the loss rises slowly,
under loss_rise's threshold), and its healthy twin (same run, the decay as configured)."""

from __future__ import annotations

from runwatch.scenarios.faults import Healthy, WeightDecayJump
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "weight_decay_x100_mlp",
        WeightDecayJump(factor=100.0),
        "mlp",
        "At step 120 AdamW's weight decay goes from 0.01 to 1.0 (a config read in the wrong units): the "
        "parameter norm falls steadily, the loss rises slowly (well under 1.3x its best), no step jumps.",
        onset=0.4,
        seed=72,
        quick_steps=200,
        schedule="constant",
    ),
    Scenario(
        "healthy_weight_decay_twin_mlp",
        Healthy(),
        "mlp",
        "The healthy twin of weight_decay_x100_mlp (same seed, schedule and data, the decay as configured): "
        "the parameter norm drifts slowly, as it does in any run.",
        seed=72,
        quick_steps=200,
        schedule="constant",
        benign=("param_norm_drift", "checkpoint", "eval"),
    ),
)
