"""Harder corpus variants: validation worsening while training improves (noisier evals, after steep early
evals), and healthy runs whose validation loss is noisy but not worsening.

Noisy evals are evals on a fresh random sample of a larger validation set (``eval_sample`` of
``val_size`` examples, as an eval on a few batches does): the validation loss jumps a few percent from
one eval to the next while its trend goes on falling, or flattens.
"""

from __future__ import annotations

from runwatch.scenarios.faults import Healthy, Overfitting
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "overfit_val_noisy_evals",
        Overfitting(),
        "mlp",
        "The overfitting run of overfit_val_mlp with noisy evals: each eval scores 128 random examples of "
        "a 2048-example validation set, so the validation loss jumps a few percent from eval to eval "
        "while it turns up. The onset is the eval step with the best validation loss.",
        seed=60,
        steps=600,
        quick_steps=300,
        eval_every=20,
        extra={"train_size": 192, "label_noise": 0.2, "val_size": 2048, "eval_sample": 128},
        lr=5e-4,
        schedule="constant",
    ),
    Scenario(
        "overfit_val_after_steep_fall",
        Overfitting(),
        "mlp",
        "A high LR on 256 samples with 20% label noise: the validation loss falls steeply over the first "
        "evals (the residuals of a steep curve are not noise), then turns up while the training loss keeps "
        "falling. The onset is the eval step with the best validation loss.",
        seed=61,
        steps=400,
        quick_steps=200,
        eval_every=10,
        extra={"train_size": 256, "label_noise": 0.2},
        lr=1.5e-3,
        schedule="constant",
    ),
    Scenario(
        "healthy_noisy_evals_mlp",
        Healthy(),
        "mlp",
        "Evals every 10 steps on 128 random examples of a 2048-example validation set: the validation loss "
        "jumps several percent from eval to eval around a falling, then flat, trend; nothing is wrong.",
        seed=62,
        steps=600,
        quick_steps=300,
        eval_every=10,
        extra={"val_size": 2048, "eval_sample": 128},
        lr=1e-3,
        schedule="constant",
        benign=("noisy_evals", "eval", "checkpoint"),
    ),
    Scenario(
        "healthy_noisy_evals_transformer",
        Healthy(),
        "transformer",
        "Evals every 10 steps on 32 random sequences of a 1024-sequence validation set, under a warm-up "
        "and cosine schedule: a steep early fall, then a plateau the noisy evals wander around.",
        seed=63,
        step_time_s=0.4,
        eval_every=10,
        extra={"val_size": 1024, "eval_sample": 32},
        benign=("noisy_evals", "lr_warmup_peak", "eval", "checkpoint"),
    ),
)
