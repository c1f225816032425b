"""From findings to actions: rules, cooldown, one rollback in flight, rollback cap.

Pure: the caller passes ``now`` (event time online and offline alike).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from runwatch.detectors.config import PolicyConfig, PolicyRule
from runwatch.producer.schema import SEVERITY_RANK, Anomaly, CheckpointRef

_ID_NAMESPACE = uuid.UUID("6f1d0a52-4c5e-4b8e-9d0c-2b7a1e3f9a10")


@dataclass(frozen=True)
class ActionDecision:
    """An action to issue; the worker stamps, signs and publishes it."""

    action_id: str
    run_id: str
    kind: str
    reason: str
    anomaly_ids: list[str]
    step: int | None
    onset_step: int | None = None
    target_checkpoint: CheckpointRef | None = None
    params: dict[str, Any] = field(default_factory=dict)


def decision_id(run_id: str, kind: str, anomaly_ids: list[str]) -> str:
    # Deterministic, so re-processing the same events after a restart yields the same id
    # and every consumer's deduplication on action_id holds.
    return uuid.uuid5(_ID_NAMESPACE, f"{run_id}|{kind}|{','.join(sorted(anomaly_ids))}").hex


class ActionPolicy:
    def __init__(self, config: PolicyConfig):
        self.config = config
        self.rollbacks = 0
        self.stopped = False
        self._pending_rollback: tuple[str, datetime] | None = None  # action id, issued at (event time)
        self._last_issued: dict[tuple[str, str], datetime] = {}

    def _rule_for(self, anomaly: Anomaly) -> PolicyRule | None:
        for rule in self.config.rules:
            if rule.detector in ("*", anomaly.detector) and SEVERITY_RANK[anomaly.severity] >= SEVERITY_RANK[
                rule.min_severity
            ]:
                return rule
        return None

    def acknowledge(self, action_id: str) -> None:
        """The trainer reported the outcome of an action: a pending rollback is settled."""
        if self._pending_rollback and self._pending_rollback[0] == action_id:
            self._pending_rollback = None

    def rollback_pending(self, now: datetime) -> bool:
        if self._pending_rollback is None:
            return False
        if now - self._pending_rollback[1] > timedelta(seconds=self.config.action_ttl_s):
            self._pending_rollback = None  # never acknowledged: the action has expired
            return False
        return True

    def decide(
        self, anomaly: Anomaly, now: datetime, checkpoint: CheckpointRef | None = None
    ) -> ActionDecision | None:
        if self.stopped:
            return None
        rule = self._rule_for(anomaly)
        if rule is None:
            return None
        kind = rule.action
        onset = anomaly.evidence.get("onset_step", anomaly.step)
        if kind == "rollback":
            if self.rollback_pending(now):
                return None  # events still in flight from before the rollback took effect
            if self.rollbacks >= self.config.max_rollbacks:
                kind = "stop"
        else:
            last = self._last_issued.get((kind, anomaly.detector))
            if last is not None and now - last < timedelta(seconds=self.config.cooldown_s):
                return None
        decision = ActionDecision(
            action_id=decision_id(anomaly.run_id, kind, [anomaly.anomaly_id]),
            run_id=anomaly.run_id,
            kind=kind,
            reason=anomaly.message,
            anomaly_ids=[anomaly.anomaly_id],
            step=anomaly.step,
            onset_step=onset,
            target_checkpoint=checkpoint if kind == "rollback" else None,
        )
        self._last_issued[(kind, anomaly.detector)] = now
        if kind == "rollback":
            self.rollbacks += 1
            self._pending_rollback = (decision.action_id, now)
        elif kind == "stop":
            self.stopped = True
        return decision
