"""An action no rank acknowledges in time raises an ``action_unacknowledged`` finding (issue 35: a trainer
with the wrong key, or no listener, counted every action as refused and the worker never learnt its rollback
did nothing). Driven through the run monitor, on event time, as the worker and the replay drive it."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import ActionAckEvent, CheckpointEvent, StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _rollback_issued(config: RunwatchConfig) -> tuple[RunMonitor, str, datetime]:
    """A healthy run with checkpoints, then its loss explodes: the policy rolls back. The monitor, the
    rollback's id and the event time it was issued at."""
    monitor = RunMonitor("r", config)
    for n, s in enumerate(range(0, 212)):
        ts = T0 + timedelta(seconds=n)
        loss = 1.0 + 0.02 * math.sin(s) if s <= 200 else 50.0
        out = monitor.observe(
            StepEvent(run_id="r", step=s, loss=loss, grad_norm=1.0, ts=ts, event_id=f"e{n}")
        )
        rollbacks = [d for d in out.decisions if d.kind == "rollback"]
        if rollbacks:
            return monitor, rollbacks[0].action_id, ts
        if s % 20 == 0:
            monitor.observe(CheckpointEvent(run_id="r", step=s, uri=f"/c/{s}", lr=[0.1], ts=ts))
    raise AssertionError("no rollback was issued")


def _unacknowledged(monitor: RunMonitor, at: datetime) -> list:
    return [a for a in monitor.tick(at).anomalies if a.detector == "action_unacknowledged"]


def test_the_alert_about_an_unanswered_action_is_not_awaited_itself():
    """The default policy alerts on the warning; that alert goes to the same silent trainer, and must not
    be said again as unanswered every ack_timeout_s."""
    config = RunwatchConfig.model_validate({"policy": {"ack_timeout_s": 30}})
    monitor, action_id, issued = _rollback_issued(config)
    out = monitor.tick(issued + timedelta(seconds=31))
    (warning,) = [a for a in out.anomalies if a.detector == "action_unacknowledged"]
    assert warning.evidence["action_id"] == action_id
    alerts = {d.action_id for d in out.decisions if d.kind == "alert" and warning.anomaly_id in d.anomaly_ids}
    assert alerts  # the default rule's alert on the warning
    later = _unacknowledged(monitor, issued + timedelta(seconds=31 + 120))
    assert not {a.evidence["action_id"] for a in later} & alerts


def test_an_action_nobody_acknowledges_is_a_finding_once_after_the_timeout():
    config = RunwatchConfig.model_validate({"policy": {"ack_timeout_s": 30}})
    monitor, action_id, issued = _rollback_issued(config)
    assert _unacknowledged(monitor, issued + timedelta(seconds=29)) == []  # not yet
    (finding,) = _unacknowledged(monitor, issued + timedelta(seconds=31))
    assert finding.severity == "warning" and finding.evidence["action_id"] == action_id
    assert f"the rollback {action_id} has no action_ack" in finding.message
    assert finding.value is not None and finding.value > 30 and finding.threshold == 30
    later = _unacknowledged(monitor, issued + timedelta(seconds=300))  # (the stalled run's own alerts)
    assert all(a.evidence["action_id"] != action_id for a in later)  # said once


def test_an_acknowledged_action_is_no_finding_whatever_its_outcome():
    config = RunwatchConfig.model_validate({"policy": {"ack_timeout_s": 30}})
    monitor, action_id, issued = _rollback_issued(config)
    monitor.observe(
        ActionAckEvent(
            run_id="r",
            action_id=action_id,
            action_kind="rollback",
            outcome="failed",  # a listener that answered, even to say it could not: it is running
            ts=issued + timedelta(seconds=5),
        )
    )
    later = _unacknowledged(monitor, issued + timedelta(seconds=600))
    assert all(a.evidence["action_id"] != action_id for a in later)


def test_the_finding_survives_a_snapshot_and_its_id_is_the_same_online_and_offline():
    import pickle

    config = RunwatchConfig.model_validate({"policy": {"ack_timeout_s": 30}})
    monitor, _, issued = _rollback_issued(config)
    restored = pickle.loads(pickle.dumps(monitor))  # a worker restart, or the partition moved
    (online,) = _unacknowledged(restored, issued + timedelta(seconds=45))
    (offline,) = _unacknowledged(monitor, issued + timedelta(seconds=31))  # another tick time
    assert online.anomaly_id == offline.anomaly_id
