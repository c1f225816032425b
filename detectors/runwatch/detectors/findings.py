"""What a detector returns: a plain record, turned into a wire ``Anomaly`` by the monitor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runwatch.contract.schema import Severity


@dataclass(frozen=True)
class Finding:
    """``onset_step``: where the detector estimates the fault began (defaults to its evidence's
    ``onset_step``, where detectors have always put it); None where it estimates none."""

    detector: str
    metric: str
    step: int | None
    severity: Severity
    message: str
    value: float | None = None
    threshold: float | None = None
    score: float | None = None
    rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    onset_step: int | None = None

    def __post_init__(self) -> None:
        if self.onset_step is None:
            onset = self.evidence.get("onset_step")
            if isinstance(onset, int) and not isinstance(onset, bool):
                object.__setattr__(self, "onset_step", onset)  # (frozen)


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
