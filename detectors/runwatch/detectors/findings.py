"""What a detector returns: a plain record, turned into a wire ``Anomaly`` by the monitor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runwatch.producer.wire.schema import Severity


@dataclass(frozen=True)
class Finding:
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


def is_finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
