"""Harder corpus variants: a training loss that rises slowly (an LR that creeps up every step) and its
benign look-alikes (a planned LR ramp-up, warm restarts).
"""

from __future__ import annotations

from runwatch.scenarios.faults import Healthy, LrRamp
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "loss_rise_lr_ramp_mlp",
        LrRamp(factor_per_step=1.01),
        "mlp",
        "From the onset the LR is multiplied by 1.01 every step (a scheduler left multiplying): no step "
        "jumps, the LR is x2.7 after 100 steps and x20 after 300; the training loss climbs slowly from "
        "about 0.3 to about 1 and the validation loss from 0.35 to 1.07.",
        onset=0.4,
        seed=40,
        steps=500,
        quick_steps=250,
        schedule="constant",
    ),
    Scenario(
        "loss_rise_lr_ramp_cosine_mlp",
        LrRamp(factor_per_step=1.01),
        "mlp",
        "The same x1.01-per-step LR creep 30% into a warm-up and cosine schedule: it first undoes "
        "the decay (the LR goes back up to its peak, as a planned restart would) and then goes past it; "
        "the loss rises only past the peak, and slowly (about x1.5 in 200 steps).",
        onset=0.3,
        seed=41,
        steps=600,
        quick_steps=300,
    ),
    Scenario(
        "healthy_long_lr_rampup_mlp",
        Healthy(),
        "mlp",
        "A long linear warm-up (120 of 600 steps) to a high but normal peak LR, then cosine decay: the LR "
        "rises for 120 steps and the loss bumps while it does, by design.",
        seed=42,
        steps=600,
        quick_steps=300,
        warmup=120,
        lr=1e-2,
        benign=("lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_long_lr_rampup_transformer",
        Healthy(),
        "transformer",
        "A long linear warm-up (100 of 500 steps) of the transformer to a high but normal peak LR: the "
        "LR rises a hundredfold over 100 steps, by design (the loss keeps falling).",
        seed=43,
        steps=500,
        quick_steps=250,
        warmup=100,
        lr=1e-2,
        step_time_s=0.4,
        benign=("lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_warm_restarts_high_lr_mlp",
        Healthy(),
        "mlp",
        "Cosine annealing with warm restarts every 200 steps to a high peak LR: at every restart the LR "
        "jumps back up twentyfold and the loss climbs x2.5 for a while before it falls again, by design.",
        seed=44,
        steps=600,
        quick_steps=300,
        schedule="warm_restarts",
        lr=1e-2,
        benign=("lr_restart", "checkpoint", "eval"),
    ),
)
