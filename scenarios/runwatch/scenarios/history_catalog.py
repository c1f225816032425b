"""The history corpus' commits: what each one changes, when, on which hardware its runs ran, and
which summary metrics it regresses (the labels).

One job (``history/audio``), one commit a day or so over about six weeks. Every labelled regression
has at least five normal runs of the same hardware before it inside 30 days, lasts three nightly runs
and is reverted by the next commit. The metric lists are what the regression really moves for the
worse (measured on the recorded runs); ``loss_at_step_*`` stands for every ``loss_at_step_N`` after
step 0 that the run records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

CommitKind = Literal["initial", "noise", "regression", "fix", "hardware_move", "new_baseline"]
BASELINE_KEY = "history/audio"
NOTES_FILE = "NOTES.md"
CONFIG_FILE = "train_config.json"
LOSS_AT_STEPS = "loss_at_step_*"


@dataclass(frozen=True)
class Commit:
    """One commit of the job's repository and the runs made at it."""

    name: str  # a short handle, used in run ids
    day: int  # simulated day of the commit
    message: str
    kind: CommitKind
    run_days: tuple[int, ...]  # one run on each of these days (nightly reruns of this commit)
    hardware: str = "cpu-a"
    config: dict[str, Any] = field(default_factory=dict)  # train_config.json changes (kept by later commits)
    note: str | None = None  # a line added to NOTES.md instead (a comment-only commit)
    metrics: tuple[str, ...] = ()  # regression: the summary metrics it makes worse
    in_flight: bool = False  # a regression that the in-flight band should find from step 0
    description: str = ""


def _noise(
    name: str,
    day: int,
    message: str,
    note: str | None = None,
    hardware: str = "cpu-a",
    run_days: tuple[int, ...] | None = None,
    config: dict[str, Any] | None = None,
) -> Commit:
    return Commit(
        name,
        day,
        message,
        "noise",
        run_days or (day,),
        hardware,
        config or {},
        note,
        description="noise only: nothing the training does changes",
    )


def _regression(
    name: str,
    day: int,
    message: str,
    config: dict[str, Any],
    metrics: tuple[str, ...],
    description: str,
    in_flight: bool = False,
) -> tuple[Commit, Commit]:
    fix = Commit(
        f"fix-{name}",
        day + 3,
        f'Revert "{message}"',
        "fix",
        (day + 3,),
        config={k: None for k in config},
        description=f"reverts {name}",
    )
    return (
        Commit(
            name,
            day,
            message,
            "regression",
            (day, day + 1, day + 2),
            config=config,
            metrics=metrics,
            in_flight=in_flight,
            description=description,
        ),
        fix,
    )


COMMITS: tuple[Commit, ...] = (
    Commit(
        "initial",
        0,
        "Audio classifier job: TinyAudioNet with an additive mel bias",
        "initial",
        (0,),
        description="the job as it starts",
    ),
    _noise(
        "notes-frontend",
        1,
        "Explain the mel frontend in the notes",
        note="The frontend adds a learnable bias per mel bin to the dB frames.",
    ),
    _noise("augment-seed", 2, "Augmentation seeds from 2000", config={"augment_seed_base": 2000}),
    _noise(
        "notes-eval", 3, "Describe the eval set", note="Eval: 256 fresh clips, uniform over the four classes."
    ),
    _noise("log-lr", 4, "Log the LR every step", config={"note": "log the LR every step"}),
    *_regression(
        "step-sync",
        5,
        "Synchronize the device every step for exact step timing",
        {"loop_overhead": 1.2},
        ("step_time_median_s", "samples_per_s", "mfu", "training_time_s"),
        "step time +20%: a device sync every step",
    ),
    _noise("notes-timing", 9, "Notes: how step time is measured", note="Step time: the watcher's own clock."),
    *_regression(
        "ema-on-device",
        10,
        "Keep EMA weights and the eval copy on the device",
        {"ema_weight_copies": 2},
        ("max_cuda_peak_bytes", "max_cuda_reserved_bytes", "max_cuda_allocated_bytes"),
        "peak memory +18%: two more copies of the weights live on the device",
    ),
    _noise("augment-seed-2", 14, "Augmentation seeds from 3000", config={"augment_seed_base": 3000}),
    *_regression(
        "micro-batch-12",
        15,
        "Micro-batches of 12 (remainder handling)",
        {"batch": 12},
        ("mfu", "samples_per_s"),
        "MFU -25% with the same step time: a smaller micro-batch on an overhead-bound device",
    ),
    _noise(
        "notes-batch", 19, "Notes: the batch size", note="Batch 16: the device is overhead-bound below it."
    ),
    *_regression(
        "long-warmup",
        20,
        "LR schedule: linear warm-up over half of the run",
        {"warmup_share": 0.5},
        (LOSS_AT_STEPS, "final_loss", "last_eval_loss", "best_eval_loss"),
        "loss at step N worse after an LR-schedule change (a warm-up over half of the run)",
    ),
    _noise("log-format", 24, "Shorter log lines", config={"note": "shorter log lines"}),
    *_regression(
        "mix-v2",
        25,
        "Data mix v2: the speech shard replaced by a second music shard",
        {"train_mix_without": "speech"},
        ("last_eval_loss", "best_eval_loss"),
        "validation loss worse while the training loss is not (a data-mix change)",
    ),
    _noise(
        "notes-mix", 29, "Notes: the data mix", note="Mix: speech, music, noise, silence, one shard each."
    ),
    *_regression(
        "randn-mel-scale",
        30,
        "Mel frontend: a learnable per-bin scale instead of the bias",
        {"model": "audio"},
        ("loss_at_step_0",),
        "the randn mel-scale init: a bare nn.Parameter(torch.randn(n_mels)) multiplied onto dB frames",
        in_flight=True,
    ),
    Commit(
        "move-cpu-b",
        34,
        "Run the job on the cpu-b pool",
        "hardware_move",
        (34, 35),
        "cpu-b",
        config={"pool": "cpu-b"},
        description="a move to other hardware: its first runs have no history",
    ),
    _noise(
        "notes-pool",
        36,
        "Notes: the cpu-b pool",
        note="cpu-b: faster hosts.",
        hardware="cpu-b",
        run_days=(36, 37),
    ),
    _noise(
        "augment-seed-3",
        38,
        "Augmentation seeds from 4000",
        config={"augment_seed_base": 4000},
        hardware="cpu-b",
        run_days=(38, 39),
    ),
    Commit(
        "batch-32",
        40,
        "Batch 32 (declared new baseline: slower steps, more memory, by design)",
        "new_baseline",
        (40, 41, 42),
        "cpu-b",
        config={"batch": 32, "step_time_scale": 1.5},
        description="a declared new baseline: later runs compare with it, not with the runs before",
    ),
    _noise(
        "notes-batch-32",
        43,
        "Notes: batch 32",
        note="Batch 32 since the new baseline.",
        hardware="cpu-b",
        run_days=(43, 44, 45, 46),
    ),
)
