"""The run's own learning rate, and putting it back on a rollback.

The *base* LR is the LR the run itself chose. runwatch records it when a checkpoint is registered
(and when an optimizer is first watched), so a rollback puts back the restored checkpoint's record,
not whatever LR the restored optimizer state carries (which may be the fault itself: an LR
multiplied by 50 and saved in the same step). The rollback's scale is not written into the LR: it
is held inside each optimizer step (``lr_hold.py``), so that it survives the loop's own LR setting.

A param group may carry a scale already written into its LR under ``runwatch_lr_scale``: an
optimizer state saved by a runwatch before the hold (a checkpoint of an older run). The base is
then the group's LR divided by it.
"""

from __future__ import annotations

import math
from typing import Any

LR_SCALE_KEY = "runwatch_lr_scale"  # in each param group: the rollback LR scale its LR already carries


def lr_value(lr: Any) -> float:
    return float(lr.item()) if hasattr(lr, "item") else float(lr)


def base_lrs(optimizer: Any) -> list[float] | None:
    """Each param group's LR without runwatch's rollback scale; None without an optimizer or on
    anything unreadable (a checkpoint is still registered, only without its LR)."""
    if optimizer is None:
        return None
    try:
        values = [lr_value(g["lr"]) / float(g.get(LR_SCALE_KEY, 1.0)) for g in optimizer.param_groups]
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return values if values and all(math.isfinite(v) and v >= 0 for v in values) else None


def set_lr(group: dict[str, Any], value: float) -> None:
    lr = group["lr"]
    if hasattr(lr, "fill_"):  # a tensor LR (capturable optimizers): keep the same tensor
        lr.fill_(value)
    else:
        group["lr"] = value


def restore_base_lr(optimizer: Any, lr_scale: float, base: list[float] | None = None) -> float:
    """Put every param group's LR back to its base: ``base`` (recorded with the restored checkpoint)
    when given for every group, else the group's LR divided by the scale written into it. Returns what
    the first group's update LR is multiplied by once ``lr_scale`` is held (``LRHold``)."""
    groups = optimizer.param_groups
    bases = base if base is not None and len(base) == len(groups) else None
    factor = 1.0
    for i, group in enumerate(groups):
        current = lr_value(group["lr"])
        carried = float(group.get(LR_SCALE_KEY, 1.0))
        target = bases[i] if bases is not None else current / carried
        if i == 0:
            factor = target * lr_scale / current if current else 1.0
        set_lr(group, target)
        group[LR_SCALE_KEY] = 1.0  # nothing written into the LR: the hold scales each update
    return factor


def scale_lr_once(optimizer: Any, lr_scale: float) -> None:
    """Write ``lr_scale`` into every param group's LR (marked under ``runwatch_lr_scale``, so its base is
    still known): for an optimizer that takes no step hooks, where the hold cannot apply it."""
    for group in optimizer.param_groups:
        set_lr(group, lr_value(group["lr"]) * lr_scale)
        group[LR_SCALE_KEY] = lr_scale
