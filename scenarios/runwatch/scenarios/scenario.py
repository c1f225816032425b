"""One scenario of the catalog: a model, a fault injector and the run's shape (steps, schedule, timing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runwatch.scenarios.injectors.base import FaultInjector


@dataclass(frozen=True)
class Scenario:
    name: str
    injector: FaultInjector
    model: str  # mlp | cnn | transformer | audio | audio_fixed (scenarios/tasks.py) | regressor (the demo's)
    description: str
    steps: int = 300
    quick_steps: int = 100
    onset: float | None = None  # fraction of the steps; the onset step is computed from it
    batch: int = 64
    lr: float = 2e-3
    schedule: str = "warmup_cosine"  # constant | warmup_cosine | step_drop | warm_restarts
    warmup: int = 20
    step_time_s: float = 0.25
    data_wait_s: float = 0.01
    noise: float = 0.05
    checkpoint_every: int = 100
    checkpoint_s: float = 6.0
    eval_every: int = 50
    eval_s: float = 4.0
    benign: tuple[str, ...] = ()
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    recorded: bool = True  # part of the labelled corpus
    # The job the run belongs to, for comparisons with history (default: the scenario's own), and how
    # many simulated days before the others it starts: runs of one key that started earlier are its history.
    baseline_key: str | None = None
    days_earlier: float = 0.0

    @property
    def fault(self) -> str:
        return self.injector.kind

    @property
    def job(self) -> str:
        """The run's ``baseline_key``."""
        return self.baseline_key or f"scenarios/{self.name}"

    def n_steps(self, quick: bool) -> int:
        return self.quick_steps if quick else self.steps

    def onset_step(self, quick: bool) -> int | None:
        return None if self.onset is None else int(round(self.onset * self.n_steps(quick)))
