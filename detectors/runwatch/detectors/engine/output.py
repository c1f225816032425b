"""What a run's monitor gives back for each event, tick or finish (``RunMonitor``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runwatch.contract.group_report import ReportItem
from runwatch.contract.schema import Anomaly, JoinedStep
from runwatch.detectors.engine.policy import ActionDecision
from runwatch.detectors.findings import Finding


@dataclass
class MonitorOutput:
    anomalies: list[Anomaly] = field(default_factory=list)
    decisions: list[ActionDecision] = field(default_factory=list)
    joined: list[JoinedStep] = field(default_factory=list)  # multi-rank runs' joined steps
    # Findings not issued because one for the same onset was (a replay after a rollback): not published
    repeated: list[Finding] = field(default_factory=list)
    # A rank group's items for the worker that merges its split run (group_monitor.py): steps as partials,
    # findings for the run's policy, run-level events
    report: list[ReportItem] = field(default_factory=list)
