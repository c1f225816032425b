"""``LRHold``: a rollback's LR scale, held inside every optimizer step, then undone gradually.

Setting the LR once at restore does not last: most loops set it every step (a scheduler, or
``group["lr"] = schedule(step)``), and the next step overrides it. So the scale is applied where
every loop's LR ends up: a step pre-hook multiplies each param group's LR by the scale, and the
post-hook puts back the LR the loop set. The update uses the scaled LR; the loop, its scheduler
(chainable schedulers read ``group["lr"]``) and its checkpoints see their own schedule.

After ``restore_after`` healthy steps in a row (an update skipped by the guard, or another rollback,
starts the count again) the scale returns to 1 linearly over ``restore_over`` steps. The scale in
force is on each step event (``lr_scale``), and each change is logged.

One hold per optimizer (``LRHold.of``): the watcher, which reports the LR the update used, and the
listener, which sets the scale, share it. Its pre-hook must run before the watcher's, so the watcher
creates it before registering its own hooks.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from runwatch.producer.publish.lr import lr_value, set_lr

log = logging.getLogger(__name__)

_HOLDS: weakref.WeakKeyDictionary[Any, LRHold] = weakref.WeakKeyDictionary()


class LRHold:
    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self.target = 1.0  # the scale a rollback set
        self.scale = 1.0  # the scale in force (target, then back to 1 over restore_over steps)
        self.restore_after: int | None = None  # None: held until the next rollback
        self.restore_over = 1
        self.healthy_steps = 0
        self._unhealthy_step = False  # this step's update was skipped: it does not count as healthy
        self._loop_lrs: list[Any] | None = None  # the LRs the loop set, while a step runs scaled
        self._scaled_lrs: list[float] = []
        self._handles = [
            optimizer.register_step_pre_hook(lambda _o, _a, _k: self._before_step()),
            optimizer.register_step_post_hook(lambda _o, _a, _k: self._after_step()),
        ]

    @classmethod
    def of(cls, optimizer: Any) -> LRHold | None:
        """The hold of ``optimizer`` (created, and its hooks registered, at the first call); a framework's
        wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) is unwrapped to
        the torch optimizer it steps. None for an optimizer that takes no step hooks (not a
        ``torch.optim.Optimizer``): a rollback then writes its scale into the LR once."""
        inner = _torch_optimizer(optimizer)
        if inner is None:
            return None
        hold = _HOLDS.get(inner)
        if hold is None:
            hold = _HOLDS[inner] = cls(inner)
        return hold

    def hold(self, scale: float, restore_after: int | None = None, restore_over: int = 100) -> None:
        """Scale every update's LR by ``scale`` from the next step; after ``restore_after`` healthy steps
        (None: never) return to 1 over ``restore_over`` steps."""
        if not 0 < scale <= 1:
            raise ValueError(f"lr scale must be in (0, 1], got {scale!r}")
        self.target = self.scale = scale
        self.restore_after, self.restore_over = restore_after, max(1, restore_over)
        self.healthy_steps = 0
        log.info(
            "runwatch: LR x%g held in every step%s",
            scale,
            f" until {restore_after} healthy steps, then back over {self.restore_over}"
            if restore_after is not None
            else "",
        )

    def unhealthy(self) -> None:
        """A step that was not healthy (its update skipped): the count to the restore starts again."""
        self.healthy_steps = 0
        self._unhealthy_step = True
        if self.scale != self.target:
            log.info("runwatch: LR back to x%g (an unhealthy step during its return)", self.target)
            self.scale = self.target

    def _before_step(self) -> None:
        if self.scale == 1.0:
            return
        groups = self.optimizer.param_groups
        if self._loop_lrs is not None and all(
            lr_value(g["lr"]) == s for g, s in zip(groups, self._scaled_lrs, strict=False)
        ):
            loop = self._loop_lrs  # the last step raised before its post-hook: its LRs are still scaled
        else:
            loop = [lr_value(g["lr"]) for g in groups]
        self._loop_lrs = loop
        self._scaled_lrs = [lr * self.scale for lr in loop]
        for group, lr in zip(groups, self._scaled_lrs, strict=True):
            set_lr(group, lr)

    def _after_step(self) -> None:
        if self._loop_lrs is not None:
            for group, lr in zip(self.optimizer.param_groups, self._loop_lrs, strict=True):
                set_lr(group, lr)
            self._loop_lrs = None
        self._count_healthy()

    def _count_healthy(self) -> None:
        unhealthy, self._unhealthy_step = self._unhealthy_step, False
        if self.target == 1.0 or self.restore_after is None or unhealthy:
            return
        self.healthy_steps += 1
        past = self.healthy_steps - self.restore_after + 1  # (the next step is the first one back)
        if past <= 0:
            return
        before = self.scale
        self.scale = min(1.0, self.target + (1.0 - self.target) * past / self.restore_over)
        if before == self.target:
            log.info(
                "runwatch: %d healthy steps: the LR returns from x%g to the schedule over %d steps",
                self.restore_after,
                self.target,
                self.restore_over,
            )
        if self.scale == 1.0:
            log.info("runwatch: the LR is back on the schedule")
            self.target = 1.0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        _HOLDS.pop(self.optimizer, None)


def held_scale(optimizer: Any) -> float:
    """The LR scale a rollback holds in ``optimizer``'s updates now (1.0: none)."""
    inner = _torch_optimizer(optimizer)
    hold = _HOLDS.get(inner) if inner is not None else None
    return hold.scale if hold is not None else 1.0


def _torch_optimizer(optimizer: Any) -> Any | None:
    import torch

    for _ in range(3):  # (a wrapper of a wrapper at most)
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if optimizer is None:
            return None
    return None
