"""Taking the worker's actions in a live training loop: what a loop does with ``listener.poll(step)``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from runwatch.producer import AppliedAction


@dataclass
class TrainingResult:
    steps_completed: int = 0
    steps_executed: int = 0
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    applied: list[AppliedAction] = field(default_factory=list)
    final_loss: float | None = None
    nonfinite_after_last_rollback: int = 0
    stopped: bool = False

    def step_executed(self, loss: float) -> None:
        self.steps_executed += 1
        if self.rollbacks and not math.isfinite(loss):
            self.nonfinite_after_last_rollback += 1
        self.final_loss = loss

    def take(
        self,
        applied_actions: Iterable[AppliedAction],
        step: int,
        on_action: Callable[[AppliedAction], None] | None = None,
    ) -> int:
        """Record the actions a poll applied at ``step``; returns the step training is at now (a
        rollback's checkpoint step, else ``step``). ``stopped`` says whether a stop came."""
        for applied in applied_actions:
            self.applied.append(applied)
            if on_action is not None:
                on_action(applied)
            if applied.kind == "rollback" and applied.outcome == "applied" and applied.to_step is not None:
                self.rollbacks.append(
                    {
                        "from_step": step,
                        "to_step": applied.to_step,
                        "action_id": applied.action.action_id,
                        "lr_scale": applied.action.params.get("lr_scale"),
                    }
                )
                self.nonfinite_after_last_rollback = 0
                step = applied.to_step
            elif applied.kind == "stop":
                self.stopped = True
        return step
