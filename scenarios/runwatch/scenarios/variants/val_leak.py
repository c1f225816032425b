"""Issue 37 shapes: validation data leaking into training (the validation loss better than it should be,
the gap to the training loss closing), and its healthy twin with the same finite training set."""

from __future__ import annotations

from runwatch.scenarios.faults import Healthy, ValidationLeak
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "val_leak_mlp",
        ValidationLeak(share=0.5),
        "mlp",
        "Training on a finite set of 1024 examples (validation loss a stable margin above the training "
        "loss); from step 150 half of every batch comes from the validation set (a split built on the wrong "
        "key): the validation loss comes out far better than it should, down to the training loss.",
        onset=0.5,
        seed=73,
        quick_steps=200,
        eval_every=10,
        schedule="constant",
        lr=1e-3,
        extra={"train_size": 1024},
    ),
    Scenario(
        "healthy_val_gap_mlp",
        Healthy(),
        "mlp",
        "The healthy twin of val_leak_mlp: the same finite training set, evals every 10 steps; the "
        "validation loss stays a stable margin above the training loss, which it slowly widens.",
        seed=73,
        quick_steps=200,
        eval_every=10,
        schedule="constant",
        lr=1e-3,
        extra={"train_size": 1024},
        benign=("val_train_gap", "eval", "checkpoint"),
    ),
)
