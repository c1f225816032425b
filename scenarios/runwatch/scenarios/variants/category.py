"""Harder corpus variants: one category's training labels shuffled from some step, seen only in the
evaluation's per-category loss (issue 37), and its healthy twin."""

from __future__ import annotations

from runwatch.scenarios.faults import CategoryLabelShuffle, Healthy
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "eval_category_shuffled_labels_mlp",
        CategoryLabelShuffle("fr"),
        "mlp",
        "From step 120 the training labels of category 'fr' (15% of the data) are shuffled (random "
        "classes: a join on the wrong key for that source); evals every 10 steps, on clean labels, see "
        "that category's loss double while the others stay flat.",
        onset=0.4,
        seed=74,
        quick_steps=200,
        eval_every=10,
        schedule="constant",
        lr=1e-3,
    ),
    Scenario(
        "healthy_eval_categories_mlp",
        Healthy(),
        "mlp",
        "The healthy twin of eval_category_shuffled_labels_mlp: evals every 10 steps with per-category "
        "losses, the rare categories noisy, none diverging.",
        seed=74,
        quick_steps=200,
        eval_every=10,
        schedule="constant",
        lr=1e-3,
        benign=("per_category_eval_noise", "eval", "checkpoint"),
    ),
)
