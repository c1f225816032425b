"""A detector's finding issued as a wire ``Anomaly``, under an id that is the same every time."""

from __future__ import annotations

import uuid
from datetime import datetime

from runwatch.contract.schema import Anomaly
from runwatch.detectors.findings import Finding

_ANOMALY_NAMESPACE = uuid.UUID("0b8f3c4e-2a71-4d3e-8f5a-7c9e1d2b6a40")


def anomaly_of(run_id: str, finding: Finding, ts: datetime, cause: str) -> Anomaly:
    """``finding`` of run ``run_id`` at ``ts``; ``cause``: what it was found on (an event id, a tick's key).
    Deterministic id: the same event re-processed gives the same anomaly (idempotent sinks)."""
    key = f"{run_id}|{finding.detector}|{finding.metric}|{finding.rank}|{cause}"
    return Anomaly(
        anomaly_id=uuid.uuid5(_ANOMALY_NAMESPACE, key).hex,
        run_id=run_id,
        step=finding.step,
        onset_step=finding.onset_step,
        rank=finding.rank,
        detector=finding.detector,
        metric=finding.metric,
        value=finding.value,
        threshold=finding.threshold,
        score=finding.score,
        severity=finding.severity,
        message=finding.message,
        evidence=finding.evidence,
        ts=ts,
    )
