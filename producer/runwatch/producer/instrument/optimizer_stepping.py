"""``OptimizerStepping``: whether the optimizer given to ``rw.watch`` still steps (issue 37).

A loop that replaces its optimizer (a fresh one after a warm-up, a "reset the optimizer" step) without
calling ``rw.watch(model, new_optimizer)`` leaves the watcher's step hooks on the old one: gradient,
weight and update figures are gone and the LR read is the old one's. The watcher notes each step of the
watched optimizer (its pre-hook) and each backward that reaches the model; a run of steps with
gradients but no optimizer step says so on the step events (``instrumentation="optimizer_not_stepping"``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The watcher's warnings keep the watcher's logger, wherever their code sits: users filter on its name.
log = logging.getLogger("runwatch.producer.instrument.watch")

# Steps in a row with a backward but no step of the watched optimizer before step events say
# ``instrumentation="optimizer_not_stepping"`` (issue 37): more than a GradScaler overflow skips (one
# step, then the scale is lower), so that is not taken for an optimizer the loop replaced.
NOT_STEPPING_STEPS = 3


class OptimizerStepping:
    """Whether the watched optimizer stepped and a backward reached ``params`` since the last step event,
    and how many steps in a row it did not step although there was a backward. ``hooked``: whether the
    watcher's own hooks are on the optimizer (``hooks=False``: the caller or a framework drives the two
    calls, and nothing is judged)."""

    def __init__(self, params: Sequence[torch.Tensor], hooked: bool) -> None:
        self._params = params
        self._hooked = hooked
        self.stepped = False  # set by the watcher's pre-hook
        self.backward = False
        self.in_a_row = 0

    def mark_backward(self, _param: Any) -> None:
        self.backward = True

    def not_stepping(self, step: int) -> bool:
        """Whether the optimizer has not stepped for ``NOT_STEPPING_STEPS`` steps in a row while the model
        had gradients: the loop most likely replaced it (a new optimizer has none of the watcher's hooks).
        Warns once; the step events say so until the watched optimizer steps again."""
        stepped, backward = self.stepped, self.backward
        self.stepped = self.backward = False
        if not self._hooked:
            return False
        if stepped:
            if self.in_a_row >= NOT_STEPPING_STEPS:
                log.warning("runwatch: step %d: the watched optimizer steps again", step)
            self.in_a_row = 0
            return False
        if not backward and not any(p.grad is not None for p in self._params):
            return self.in_a_row >= NOT_STEPPING_STEPS  # no backward this step: no new evidence
        self.in_a_row += 1
        if self.in_a_row == NOT_STEPPING_STEPS:
            log.warning(
                "runwatch: step %d: the optimizer given to rw.watch has not stepped for %d steps while the "
                "model has gradients: a new optimizer? call rw.watch(model, new_optimizer) (step events "
                "carry no gradient, weight or update figures, and the LR reported is the old optimizer's)",
                step,
                self.in_a_row,
            )
        return self.in_a_row >= NOT_STEPPING_STEPS


def backward_marker(params: Sequence[torch.Tensor], mark: Callable[[Any], None]) -> list[Any]:
    """A hook on the first trainable parameter that calls ``mark`` when a backward reached the model: a loop
    that zeroes the gradients (``set_to_none``) before ``end_step`` leaves none to see there. One Python
    call per backward; none where this torch lacks post-accumulate-grad hooks."""
    for p in params:
        if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
            return [p.register_post_accumulate_grad_hook(mark)]  # type: ignore[no-untyped-call] # torch leaves it unannotated
    return []
