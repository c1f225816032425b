"""The fault injector's hooks (``FaultInjector``, which injects nothing: ``Healthy``) and what it may know
of the run it is injected into (``FaultRun``)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from torch import nn

from runwatch.scenarios.tasks import Batch, Task


@dataclass
class FaultRun:
    """What an injector may know about the run it is injected into."""

    onset: int | None  # the step the fault starts at (None: no fault)
    steps: int
    model: nn.Module
    seed: int = 0
    step_time_s: float = 0.0  # the scenario's modelled compute time per step
    base_lr: Callable[[int], float] = lambda _step: 0.0  # the schedule's LR at a step
    mark_onset: Callable[[], None] = lambda: None  # record the onset's wall time (once)


@dataclass
class FaultInjector:
    """No fault: every hook leaves the step as it is. Subclasses override the hooks their fault needs."""

    kind: ClassVar[str] = "healthy"

    def for_run(self) -> Self:
        return dataclasses.replace(self)

    def start(self, run: FaultRun) -> None:
        self.run = run

    # -- what the labels and the recorded config say about the fault
    def describe(self) -> dict[str, Any]:
        """``module``, ``category``, ``kind`` and ``magnitude`` (None where they do not apply)."""
        return {"module": None, "category": None, "kind": None, "magnitude": None}

    def label_fields(self) -> dict[str, Any]:
        fields = {k: v for k, v in self.describe().items() if k != "magnitude" and v is not None}
        magnitude = self.describe()["magnitude"]
        if magnitude is not None:
            fields["magnitude"] = magnitude if math.isfinite(magnitude) else str(magnitude)
        return fields

    # -- when
    def active(self, step: int) -> bool:
        return self.run.onset is not None and step >= self.run.onset

    def at_onset(self, step: int) -> bool:
        return self.run.onset is not None and step == self.run.onset

    # -- the hooks, in the order a step calls them
    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        return wait

    def batch_length(self, step: int) -> int | None:
        return None

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        return batch

    def optimizer(self, step: int, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps from this step on (a fault may replace it)."""
        return optimizer

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        pass

    def forward(self, model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        return cast(torch.Tensor, model(x))

    def loss(self, loss: torch.Tensor, logits: torch.Tensor, step: int) -> torch.Tensor:
        return loss

    def backward_loss(
        self, loss: torch.Tensor, per_sample: torch.Tensor, batch: Batch, step: int
    ) -> torch.Tensor:
        return loss

    def retain(self, model: nn.Module, batch: Batch, logits: torch.Tensor, step: int) -> list[int]:
        """Bytes of the tensors this step keeps alive for good (the memory model allocates them)."""
        return []

    def compute_time(self, seconds: float, step: int) -> float:
        return seconds

    def step_computed(self, step: int) -> None:
        """The step's compute time has passed: a fault that starts here has its onset now."""
        if self.at_onset(step):
            self.run.mark_onset()

    def step_published(self, step: int, advance: Callable[[float], None]) -> str | None:
        """After the step's event: the run_end status if the run ends here, else None."""
        return None

    def onset_from_evals(self, best_val: tuple[float, int, Any] | None) -> tuple[int, Any, float] | None:
        """(onset step, onset time, best validation loss) where the onset is only known afterwards."""
        return None


Healthy = FaultInjector
