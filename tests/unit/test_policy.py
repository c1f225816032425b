"""From findings to actions. A critical NaN streak must become exactly one rollback to a checkpoint
taken strictly before the onset; no second rollback while one is in flight (until it is acknowledged
or expires); after ``max_rollbacks`` the run is stopped and then left alone; alerts respect their
cooldown; and action ids are deterministic so re-processing after a restart deduplicates."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from runwatch.detectors.config import PolicyConfig, PolicyRule, RunwatchConfig
from runwatch.detectors.monitor import RunMonitor
from runwatch.detectors.policy import ActionPolicy
from runwatch.producer.schema import (
    ActionAckEvent,
    Anomaly,
    CheckpointEvent,
    CheckpointRef,
    StepEvent,
)

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _anomaly(
    anomaly_id: str = "an-1",
    detector: str = "non_finite",
    severity: str = "critical",
    step: int = 12,
    onset: int | None = 10,
    run_id: str = "run-1",
) -> Anomaly:
    evidence = {"onset_step": onset} if onset is not None else {}
    return Anomaly(
        anomaly_id=anomaly_id, run_id=run_id, step=step, detector=detector, metric="loss",
        severity=severity, message=f"{detector} {severity} at {step}", evidence=evidence, ts=T0,
    )


# -- through RunMonitor: checkpoint choice and the whole NaN path ---------------------------------


def _step_event(step: int, loss: float, run_id: str = "run-1") -> StepEvent:
    return StepEvent(run_id=run_id, step=step, loss=loss, ts=_at(step), event_id=f"e{step}")


def _ckpt(step: int, ok: bool = True) -> CheckpointEvent:
    return CheckpointEvent(run_id="run-1", step=step, uri=f"/ckpt/{step}.pt", ok=ok, ts=_at(step))


def _run_nan(monitor: RunMonitor, first_nan: int, last: int, start: int = 0):
    anomalies, decisions = [], []
    for s in range(start, last + 1):
        out = monitor.observe(_step_event(s, math.nan if s >= first_nan else 1.0))
        anomalies += out.anomalies
        decisions += out.decisions
    return anomalies, decisions


def test_nan_streak_gives_alert_then_rollback_to_checkpoint_before_onset():
    monitor = RunMonitor("run-1", RunwatchConfig())
    for s in range(0, 10):
        monitor.observe(_step_event(s, 1.0))
        if s in (0, 4):
            monitor.observe(_ckpt(s))
    monitor.observe(_ckpt(8, ok=False))  # failed checkpoint: never a rollback target
    monitor.observe(_ckpt(10))  # taken at the onset step: may already be poisoned
    anomalies, decisions = _run_nan(monitor, first_nan=10, last=14, start=10)

    assert [(a.step, a.severity) for a in anomalies] == [(10, "warning"), (12, "critical")]
    assert [d.kind for d in decisions] == ["alert", "rollback"]
    rollback = decisions[1]
    assert rollback.onset_step == 10
    assert rollback.step == 12
    assert rollback.target_checkpoint == CheckpointRef(step=4, uri="/ckpt/4.pt")
    assert rollback.anomaly_ids == [anomalies[1].anomaly_id]
    assert rollback.run_id == "run-1"
    assert decisions[0].target_checkpoint is None


def test_rollback_without_any_earlier_checkpoint_has_no_target():
    monitor = RunMonitor("run-1", RunwatchConfig())
    monitor.observe(_ckpt(5))
    _, decisions = _run_nan(monitor, first_nan=3, last=6)
    rollback = [d for d in decisions if d.kind == "rollback"]
    assert len(rollback) == 1 and rollback[0].target_checkpoint is None


def test_no_second_rollback_while_one_is_pending_then_allowed_after_ack():
    monitor = RunMonitor("run-1", RunwatchConfig())
    monitor.observe(_ckpt(0))
    _, first = _run_nan(monitor, first_nan=5, last=8)
    rollbacks = [d for d in first if d.kind == "rollback"]
    assert len(rollbacks) == 1

    # events still in flight from before the rollback took effect: another streak, no new rollback
    found, second = _run_nan(monitor, first_nan=10, last=13, start=9)
    assert [a.severity for a in found] == ["warning", "critical"]
    assert [d.kind for d in second if d.kind == "rollback"] == []

    monitor.observe(ActionAckEvent(run_id="run-1", action_id=rollbacks[0].action_id, outcome="applied", ts=_at(14)))
    _, third = _run_nan(monitor, first_nan=16, last=19, start=15)
    again = [d for d in third if d.kind == "rollback"]
    assert len(again) == 1
    assert again[0].onset_step == 16
    assert again[0].action_id != rollbacks[0].action_id


def test_ack_of_another_action_does_not_release_the_pending_rollback():
    policy = ActionPolicy(PolicyConfig())
    first = policy.decide(_anomaly("a1"), _at(0))
    assert first.kind == "rollback"
    policy.acknowledge("not-the-rollback")
    assert policy.decide(_anomaly("a2"), _at(1)) is None
    policy.acknowledge(first.action_id)
    assert policy.decide(_anomaly("a3"), _at(2)).kind == "rollback"


# -- ActionPolicy directly ------------------------------------------------------------------------


def test_default_rules_warning_alerts_and_info_is_ignored():
    policy = ActionPolicy(PolicyConfig())
    alert = policy.decide(_anomaly(severity="warning", step=10), _at(0))
    assert alert.kind == "alert" and alert.target_checkpoint is None
    assert policy.decide(_anomaly("an-2", detector="loss_spike", severity="info"), _at(1)) is None


def test_critical_spike_is_only_an_alert_by_default():
    policy = ActionPolicy(PolicyConfig())
    decision = policy.decide(_anomaly(detector="loss_spike", severity="critical"), _at(0))
    assert decision.kind == "alert"


def test_first_matching_rule_wins():
    rules = [
        PolicyRule(detector="loss_spike", min_severity="critical", action="pause"),
        PolicyRule(detector="*", min_severity="warning", action="alert"),
        PolicyRule(detector="loss_spike", min_severity="warning", action="stop"),
    ]
    policy = ActionPolicy(PolicyConfig(rules=rules, cooldown_s=0))
    assert policy.decide(_anomaly("a", detector="loss_spike", severity="critical"), _at(0)).kind == "pause"
    assert policy.decide(_anomaly("b", detector="loss_spike", severity="warning"), _at(1)).kind == "alert"
    assert policy.decide(_anomaly("c", detector="grad_norm_spike", severity="critical"), _at(2)).kind == "alert"


def test_rollback_target_is_the_checkpoint_passed_in():
    policy = ActionPolicy(PolicyConfig())
    ref = CheckpointRef(step=3, uri="/c/3")
    decision = policy.decide(_anomaly(), _at(0), checkpoint=ref)
    assert decision.target_checkpoint == ref and decision.onset_step == 10


def test_after_max_rollbacks_the_next_is_stop_and_then_nothing():
    policy = ActionPolicy(PolicyConfig(max_rollbacks=2))
    kinds = []
    for i in range(3):
        decision = policy.decide(_anomaly(f"nan-{i}", step=10 * i + 2, onset=10 * i), _at(10 * i))
        kinds.append(decision.kind)
        policy.acknowledge(decision.action_id)
    assert kinds == ["rollback", "rollback", "stop"]
    assert policy.stopped
    # nothing at all after a stop, of any kind
    assert policy.decide(_anomaly("nan-9", step=92, onset=90), _at(100)) is None
    assert policy.decide(_anomaly("spike", detector="loss_spike", severity="warning"), _at(200)) is None


def test_max_rollbacks_zero_stops_at_once():
    policy = ActionPolicy(PolicyConfig(max_rollbacks=0))
    decision = policy.decide(_anomaly(), _at(0), checkpoint=CheckpointRef(step=1, uri="/c"))
    assert decision.kind == "stop"
    assert decision.target_checkpoint is None


def test_alert_cooldown_per_detector():
    policy = ActionPolicy(PolicyConfig(cooldown_s=60))
    warn = dict(detector="loss_spike", severity="warning")
    assert policy.decide(_anomaly("a1", **warn), _at(0)).kind == "alert"
    assert policy.decide(_anomaly("a2", **warn), _at(30)) is None
    assert policy.decide(_anomaly("a3", **warn), _at(59.9)) is None
    # another detector has its own cooldown
    assert policy.decide(_anomaly("g1", detector="grad_norm_spike", severity="warning"), _at(31)).kind == "alert"
    assert policy.decide(_anomaly("a4", **warn), _at(61)).kind == "alert"


def test_suppressed_alert_does_not_extend_the_cooldown():
    policy = ActionPolicy(PolicyConfig(cooldown_s=60))
    warn = dict(detector="loss_spike", severity="warning")
    policy.decide(_anomaly("a1", **warn), _at(0))
    assert policy.decide(_anomaly("a2", **warn), _at(50)) is None
    assert policy.decide(_anomaly("a3", **warn), _at(65)) is not None


def test_same_anomaly_gives_the_same_action_id():
    first = ActionPolicy(PolicyConfig()).decide(_anomaly("an-42"), _at(0))
    second = ActionPolicy(PolicyConfig()).decide(_anomaly("an-42"), _at(500))
    assert first.action_id == second.action_id
    other = ActionPolicy(PolicyConfig()).decide(_anomaly("an-43"), _at(0))
    assert other.action_id != first.action_id
    other_run = ActionPolicy(PolicyConfig()).decide(_anomaly("an-42", run_id="run-2"), _at(0))
    assert other_run.action_id != first.action_id


def test_replaying_the_same_events_gives_the_same_ids():
    def replay():
        monitor = RunMonitor("run-1", RunwatchConfig())
        monitor.observe(_ckpt(0))
        return _run_nan(monitor, first_nan=5, last=9)

    anomalies_a, decisions_a = replay()
    anomalies_b, decisions_b = replay()
    assert [a.anomaly_id for a in anomalies_a] == [a.anomaly_id for a in anomalies_b]
    assert [d.action_id for d in decisions_a] == [d.action_id for d in decisions_b]
    assert len(decisions_a) == 2


def test_pending_rollback_expires_after_action_ttl():
    policy = ActionPolicy(PolicyConfig(action_ttl_s=120))
    first = policy.decide(_anomaly("n1"), _at(0))
    assert first.kind == "rollback"
    assert policy.rollback_pending(_at(100))
    assert policy.decide(_anomaly("n2"), _at(119)) is None
    assert not policy.rollback_pending(_at(121))
    second = policy.decide(_anomaly("n3"), _at(121))
    assert second is not None and second.kind == "rollback"
    assert policy.rollbacks == 2
