"""Harder corpus variants: LR faults milder than the corpus's x100 and x1e-4, inside a schedule that moves
the LR on its own (a warm-up and cosine decay, a planned step drop), found at the step they happen.
"""

from __future__ import annotations

from runwatch.scenarios.faults import UpdateRatio
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "lr_too_large_mild_mlp",
        UpdateRatio(lr_scale=10.0),
        "mlp",
        "Mid-way through a warm-up + cosine schedule a config override sets the LR x10 (not x100): the "
        "update ratio rises tenfold while the schedule itself only ever lowers the LR.",
        onset=0.5,
        seed=40,
    ),
    Scenario(
        "lr_vanishing_mild_transformer",
        UpdateRatio(lr_scale=1e-3),
        "transformer",
        "At 40% the LR falls x1e-3 (a decay applied per step instead of per epoch), before the schedule's "
        "own planned x0.1 drop at 60%: updates shrink a thousandfold and training crawls.",
        onset=0.4,
        seed=41,
        schedule="step_drop",
        step_time_s=0.4,
    ),
)
