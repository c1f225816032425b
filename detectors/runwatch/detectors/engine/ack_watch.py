"""Actions no rank acknowledged in time: an ``action_unacknowledged`` finding, once per action.

A trainer's listener acknowledges every action it receives for its run (``action_ack``: applied, failed, or
refused). None within ``policy.ack_timeout_s`` means the action did nothing: the listener is not running,
it cannot reach the broker, or it refuses the workers' signature (a key that is not theirs). Pure: the
monitor tells it what was issued and acknowledged, and asks at its ticks with the event-time ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import datetime

from runwatch.detectors.engine.policy import ActionDecision
from runwatch.detectors.findings import Finding

NAME = "action_unacknowledged"
MAX_WAITING = 64  # a run has few actions in flight; past this the oldest is forgotten, not judged


class AckWatch:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # action id -> (kind, issued at, step), oldest first
        self._waiting: OrderedDict[str, tuple[str, datetime, int | None]] = OrderedDict()

    def issued(self, decision: ActionDecision, at: datetime) -> None:
        self._waiting[decision.action_id] = (decision.kind, at, decision.step)
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)

    def acknowledged(self, action_id: str) -> None:
        self._waiting.pop(action_id, None)

    def overdue(self, now: datetime) -> list[Finding]:
        """A warning for each action issued more than ``timeout_s`` before ``now`` with no acknowledgement
        (then forgotten: one finding per action)."""
        found = []
        for action_id, (kind, at, step) in list(self._waiting.items()):
            waited = (now - at).total_seconds()
            if waited <= self.timeout_s:
                break  # (oldest first: the rest are younger)
            del self._waiting[action_id]
            found.append(
                Finding(
                    detector=NAME,
                    metric="action_ack",
                    step=step,
                    severity="warning",
                    value=waited,
                    threshold=self.timeout_s,
                    message=(
                        f"the {kind} {action_id} has no action_ack from any rank {waited:.0f} s after it was "
                        "issued: it did nothing. Is the trainer's ActionListener running, and does it "
                        "verify the workers' signature (the listener logs a warning when it refuses one)?"
                    ),
                    evidence={"action_id": action_id, "action_kind": kind, "issued_at": at.isoformat()},
                )
            )
        return found
