"""Issue 37 shapes: modules frozen mid-run (their gradient gone, reported as exactly 0.0), and the benign
look-alike, a module frozen from the start and unfrozen by design (gradual unfreezing)."""

from __future__ import annotations

from runwatch.scenarios.faults import FrozenModules, GradualUnfreezing
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "frozen_modules_mlp",
        FrozenModules(("encoder.0", "encoder.2")),
        "mlp",
        "At step 120 a fine-tuning script freezes the encoder (requires_grad_(False) on encoder.0 and "
        "encoder.2) at the wrong step: their gradient norms are exactly 0.0 from then on, the head trains on "
        "and the loss barely moves.",
        onset=0.4,
        seed=70,
        quick_steps=150,
    ),
    Scenario(
        "healthy_gradual_unfreezing_mlp",
        GradualUnfreezing(("encoder.0",), unfreeze_at=0.3),
        "mlp",
        "Gradual unfreezing, by design: encoder.0 is frozen from step 0 (gradient norm 0.0) and unfrozen at "
        "30% of the run; then it trains like the rest.",
        seed=71,
        quick_steps=150,
        benign=("frozen_from_start", "unfreezing", "lr_warmup_peak", "checkpoint", "eval"),
    ),
)
