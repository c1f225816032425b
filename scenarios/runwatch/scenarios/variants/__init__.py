"""The harder corpus variants (issue 27), one module per shape, each a labelled fault or a healthy run
with the benign pattern a detector could take for that fault."""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.variants import (
    activations,
    category,
    frozen,
    generalization,
    learning_rate,
    loss_rise,
    memory,
    optimizer_swap,
    throughput,
    val_leak,
    weight_decay,
)

HARDER_VARIANTS: tuple[Scenario, ...] = (
    *memory.VARIANTS,
    *throughput.VARIANTS,
    *generalization.VARIANTS,
    *category.VARIANTS,
    *learning_rate.VARIANTS,
    *loss_rise.VARIANTS,
    *frozen.VARIANTS,
    *weight_decay.VARIANTS,
    *val_leak.VARIANTS,
    *optimizer_swap.VARIANTS,
    *activations.VARIANTS,
)
