"""``RunMonitor``: all detector and policy state of one run, fed one event at a time.

It runs inside the Faust worker and takes no I/O and no clock (event timestamps are its
only time), so the same code can replay a recorded stream offline. Its state pickles.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.findings import Finding
from runwatch.detectors.nonfinite import NonFiniteDetector
from runwatch.detectors.policy import ActionDecision, ActionPolicy
from runwatch.detectors.spike import SpikeDetector
from runwatch.producer.schema import (
    ActionAckEvent,
    Anomaly,
    CheckpointEvent,
    CheckpointRef,
    StepEvent,
    TelemetryEvent,
    newest_checkpoint_before,
)

_ANOMALY_NAMESPACE = uuid.UUID("0b8f3c4e-2a71-4d3e-8f5a-7c9e1d2b6a40")


@dataclass
class MonitorOutput:
    anomalies: list[Anomaly] = field(default_factory=list)
    decisions: list[ActionDecision] = field(default_factory=list)


class RankDetectors:
    """The step detectors of one rank."""

    def __init__(self, config: RunwatchConfig):
        d = config.detectors
        self.non_finite = NonFiniteDetector(d.non_finite) if d.non_finite.enabled else None
        self.loss_spike = SpikeDetector("loss_spike", "loss", d.loss_spike) if d.loss_spike.enabled else None
        self.grad_spike = (
            SpikeDetector("grad_norm_spike", "grad_norm", d.grad_norm_spike) if d.grad_norm_spike.enabled else None
        )

    def update(self, event: StepEvent) -> list[Finding]:
        found = []
        if self.non_finite is not None:
            found.append(self.non_finite.update(event))
        if self.loss_spike is not None:
            found.append(self.loss_spike.update(event.loss, event.step, event.rank))
        if self.grad_spike is not None:
            found.append(self.grad_spike.update(event.grad_norm, event.step, event.rank))
        return [f for f in found if f is not None]


class RunMonitor:
    def __init__(self, run_id: str, config: RunwatchConfig):
        self.run_id = run_id
        self.config = config
        self.ranks: dict[int, RankDetectors] = {}
        self.policy = ActionPolicy(config.policy)
        self.checkpoints: list[CheckpointRef] = []
        self.events_seen = 0
        self.last_step: int | None = None

    def observe(self, event: TelemetryEvent) -> MonitorOutput:
        self.events_seen += 1
        out = MonitorOutput()
        if isinstance(event, StepEvent):
            self.last_step = event.step
            detectors = self.ranks.get(event.rank)
            if detectors is None:
                detectors = self.ranks[event.rank] = RankDetectors(self.config)
            for finding in detectors.update(event):
                anomaly = self._to_anomaly(finding, event)
                out.anomalies.append(anomaly)
                decision = self.policy.decide(anomaly, event.ts, self._checkpoint_before(anomaly))
                if decision is not None:
                    out.decisions.append(decision)
        elif isinstance(event, CheckpointEvent):
            if event.ok:
                self.checkpoints.append(CheckpointRef(step=event.step, uri=event.uri))
        elif isinstance(event, ActionAckEvent):
            self.policy.acknowledge(event.action_id)
        return out

    def _checkpoint_before(self, anomaly: Anomaly) -> CheckpointRef | None:
        onset = anomaly.evidence.get("onset_step", anomaly.step)
        return None if onset is None else newest_checkpoint_before(self.checkpoints, onset)

    def _to_anomaly(self, finding: Finding, event: StepEvent) -> Anomaly:
        # Deterministic id: the same event re-processed gives the same anomaly (idempotent sinks).
        key = f"{self.run_id}|{finding.detector}|{finding.metric}|{finding.rank}|{event.event_id}"
        return Anomaly(
            anomaly_id=uuid.uuid5(_ANOMALY_NAMESPACE, key).hex,
            run_id=self.run_id,
            step=finding.step,
            rank=finding.rank,
            detector=finding.detector,
            metric=finding.metric,
            value=finding.value,
            threshold=finding.threshold,
            score=finding.score,
            severity=finding.severity,
            message=finding.message,
            evidence=finding.evidence,
            ts=event.ts,
        )
