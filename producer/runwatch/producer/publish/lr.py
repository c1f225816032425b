"""The run's own learning rate, and setting it on a rollback.

Each param group carries the rollback scale already in its LR under ``runwatch_lr_scale`` (saved
and restored with the optimizer's state). The *base* LR is the group's LR without that scale: the
LR the run itself chose. runwatch records it when a checkpoint is registered (and when an
optimizer is first watched), so a rollback sets ``base x lr_scale`` from the restored
checkpoint's record, not from whatever LR the restored optimizer state carries (which may be the
fault itself: an LR multiplied by 50 and saved in the same step).
"""

from __future__ import annotations

import math
from typing import Any

LR_SCALE_KEY = "runwatch_lr_scale"  # in each param group: the rollback LR scale its LR already carries


def _lr_value(lr: Any) -> float:
    return float(lr.item()) if hasattr(lr, "item") else float(lr)


def base_lrs(optimizer: Any) -> list[float] | None:
    """Each param group's LR without runwatch's rollback scale; None without an optimizer or on
    anything unreadable (a checkpoint is still registered, only without its LR)."""
    if optimizer is None:
        return None
    try:
        values = [_lr_value(g["lr"]) / float(g.get(LR_SCALE_KEY, 1.0)) for g in optimizer.param_groups]
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return values if values and all(math.isfinite(v) and v >= 0 for v in values) else None


def _set(group: dict[str, Any], value: float) -> None:
    lr = group["lr"]
    if hasattr(lr, "fill_"):  # a tensor LR (capturable optimizers): keep the same tensor
        lr.fill_(value)
    else:
        group["lr"] = value


def scale_lr(optimizer: Any, lr_scale: float, base: list[float] | None = None) -> float:
    """Set every param group's LR to ``lr_scale`` times its base LR: ``base`` (recorded with the
    restored checkpoint) when given for every group, else the group's LR divided by the scale it
    carries. Returns the factor applied to the first group's LR."""
    groups = optimizer.param_groups
    bases = base if base is not None and len(base) == len(groups) else None
    factor = 1.0
    for i, group in enumerate(groups):
        current = _lr_value(group["lr"])
        carried = float(group.get(LR_SCALE_KEY, 1.0))
        target = (bases[i] if bases is not None else current / carried) * lr_scale
        if i == 0:
            factor = target / current if current else 1.0
        _set(group, target)
        group[LR_SCALE_KEY] = lr_scale
    return factor
