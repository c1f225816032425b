"""Harder corpus variants: one category's training labels shuffled from some step, seen only in the
evaluation's per-category loss (issue 37), and its healthy twin; a category already near chance loss
whose wrong labels move its mean little but its tail a lot (issue 37, item 5), and its healthy twin."""

from __future__ import annotations

from runwatch.scenarios.faults import CategoryDivergence, CategoryLabelShuffle, Healthy
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
    Scenario(
        "category_near_chance_cnn",
        CategoryDivergence("pt", share=0.21),
        "cnn",
        "From the onset a growing share (up to 21% after 100 steps) of the images of source 'pt' (8% of "
        "the data, the noisiest source: its loss sits near chance) carry wrong labels (a fixed "
        "permutation): its mean moves 1.2-1.4x, within its own drift, but its samples crowd the batch's "
        "worst tenth.",
        steps=400,
        onset=0.5,
        seed=62,
        step_time_s=0.3,
        quick_steps=300,
    ),
    Scenario(
        "healthy_categories_cnn",
        Healthy(),
        "cnn",
        "The healthy twin of category_near_chance_cnn: the same CNN run with its noisy, near-chance "
        "source 'pt' learning slower than the others and drifting against them, nothing injected.",
        steps=400,
        seed=62,
        step_time_s=0.3,
        quick_steps=300,
        benign=("hard_category", "checkpoint", "eval"),
    ),
)
