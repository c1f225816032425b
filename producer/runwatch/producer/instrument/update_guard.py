"""``UpdateGuard``: the step guard's verdict carried out in the trainer: a refused update does not land.

:class:`~runwatch.producer.instrument.guard.StepGuard` judges two numbers; this reads them from the step's
gradient norms (one small read from the device: the norm and the count of non-finite tensors) and, on a
skip, takes the gradients away (with an optimizer, so that its ``step()`` leaves every parameter and its
state as they were), tells the rollback's LR hold (publish/lr_hold.py) that the step was not healthy, and
warns (the first skip of a run of them, then every 100th).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from runwatch.producer.instrument.gradstats import GradNorms, HostGradNorms
from runwatch.producer.instrument.guard import SkipReason, StepGuard

if TYPE_CHECKING:
    import torch

    from runwatch.producer.publish.lr_hold import LRHold

# The watcher's warnings keep the watcher's logger, wherever their code sits: users filter on its name.
log = logging.getLogger("runwatch.producer.instrument.watch")


class UpdateGuard:
    """``guard``'s verdict on each step's gradient. ``params``: the parameters whose gradients a skip takes
    away (None: a hand-written update, which asks ``Watcher.should_skip`` instead); ``lr_hold``: the
    optimizer's LR hold, if any."""

    def __init__(
        self, guard: StepGuard, params: Sequence[torch.Tensor] | None, lr_hold: LRHold | None
    ) -> None:
        self.guard = guard
        self._params = params
        self._lr_hold = lr_hold

    def judge(self, grad: GradNorms | HostGradNorms, step: int) -> SkipReason | None:
        """The verdict on step ``step``'s gradient: None to apply the update, else why it is skipped (and
        then it is: the gradients are gone)."""
        norm: float
        nonfinite: float
        if isinstance(grad, HostGradNorms):
            norm, nonfinite = grad.total, grad.nonfinite
        else:
            norm, nonfinite = grad.figures[-1].item(), grad.nonfinite.item()  # (on CUDA the first one syncs)
        guard = self.guard
        reason = guard.judge(norm, nonfinite)
        if reason is None:
            return None
        if self._params is not None:
            for p in self._params:
                p.grad = None
        if self._lr_hold is not None:
            self._lr_hold.unhealthy()
        if guard.in_a_row == 1 or guard.in_a_row % 100 == 0:
            log.warning(
                "runwatch: step %d: update skipped (%s gradient%s; %d in a row)",
                step,
                "non-finite" if reason == "nonfinite" else "outlier",
                "" if reason == "nonfinite" else f" norm {norm:.4g} > {guard.limit or 0:.4g}",
                guard.in_a_row,
            )
        return reason
