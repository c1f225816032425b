"""From findings to actions. A critical NaN streak must become exactly one rollback to a checkpoint
taken strictly before the onset; no second rollback while one is in flight (until it is acknowledged
or expires); after ``max_rollbacks`` the run is stopped and then left alone; alerts respect their
cooldown; and action ids are deterministic so re-processing after a restart deduplicates."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import (
    ActionAckEvent,
    Anomaly,
    CheckpointEvent,
    CheckpointRef,
    StepEvent,
)
from runwatch.detectors.config import PolicyConfig, PolicyRule, RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor
from runwatch.detectors.engine.policy import ActionPolicy

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
GOOD = CheckpointRef(step=3, uri="/c/3")  # a confirmed-good checkpoint the caller names as the target


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
        anomaly_id=anomaly_id,
        run_id=run_id,
        step=step,
        detector=detector,
        metric="loss",
        severity=severity,
        message=f"{detector} {severity} at {step}",
        evidence=evidence,
        ts=T0,
    )


# -- through RunMonitor: checkpoint choice and the whole NaN path ---------------------------------


def _step_event(step: int, loss: float, run_id: str = "run-1") -> StepEvent:
    return StepEvent(run_id=run_id, step=step, loss=loss, ts=_at(step), event_id=f"e{step}")


def _ckpt(step: int, ok: bool = True) -> CheckpointEvent:
    return CheckpointEvent(run_id="run-1", step=step, uri=f"/ckpt/{step}.pt", ok=ok, ts=_at(step))


def _applied(action_id: str, to_step: int, t: float) -> ActionAckEvent:
    """Rank 0's acknowledgement of a rollback to ``to_step``, applied at time ``t``."""
    return ActionAckEvent(
        run_id="run-1",
        action_id=action_id,
        action_kind="rollback",
        outcome="applied",
        to_step=to_step,
        ts=_at(t),
    )


def _run_nan(monitor: RunMonitor, first_nan: int, last: int, start: int = 0):
    anomalies, decisions = [], []
    for s in range(start, last + 1):
        out = monitor.observe(_step_event(s, math.nan if s >= first_nan else 1.0))
        anomalies += out.anomalies
        decisions += out.decisions
    return anomalies, decisions


def test_nan_streak_gives_alert_then_rollback_to_the_newest_confirmed_checkpoint_before_onset():
    monitor = RunMonitor("run-1", RunwatchConfig())  # confirm_steps 20
    for s in range(0, 30):
        monitor.observe(_step_event(s, 1.0))
        if s in (0, 4, 20, 28):
            monitor.observe(_ckpt(s))
    monitor.observe(_ckpt(26, ok=False))  # failed checkpoint: never a rollback target
    monitor.observe(_ckpt(30))  # taken at the onset step: may already be poisoned
    anomalies, decisions = _run_nan(monitor, first_nan=30, last=34, start=30)

    assert [(a.step, a.severity) for a in anomalies] == [(30, "warning"), (32, "critical")]
    assert [d.kind for d in decisions] == ["alert", "rollback"]
    rollback = decisions[1]
    assert rollback.onset_step == 30
    assert rollback.step == 32
    # 20 and 28 had not had their 20 healthy steps: never restored; 4 had (at step 24)
    assert rollback.target_checkpoint == CheckpointRef(step=4, uri="/ckpt/4.pt")
    assert rollback.anomaly_ids == [anomalies[1].anomaly_id]
    assert rollback.run_id == "run-1"
    assert decisions[0].target_checkpoint is None


def test_without_a_confirmed_checkpoint_a_rollback_becomes_a_stop_or_a_pause():
    for choice in ("stop", "pause"):
        config = RunwatchConfig.model_validate({"policy": {"no_good_checkpoint": choice}})
        monitor = RunMonitor("run-1", config)
        monitor.observe(_ckpt(0))  # registered, but only 2 healthy steps follow it
        _, decisions = _run_nan(monitor, first_nan=3, last=6)
        assert [d.kind for d in decisions] == ["alert", choice]
        assert decisions[1].target_checkpoint is None and decisions[1].params == {
            "cause": "no_good_checkpoint"
        }
        assert "no confirmed-good checkpoint" in decisions[1].reason


def test_no_second_rollback_while_one_is_pending_then_allowed_after_ack():
    monitor = RunMonitor("run-1", RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}))
    monitor.observe(_ckpt(0))  # confirmed at step 6
    _, first = _run_nan(monitor, first_nan=8, last=11)
    rollbacks = [d for d in first if d.kind == "rollback"]
    assert len(rollbacks) == 1

    # events still in flight from before the rollback took effect: another streak, no new rollback
    found, second = _run_nan(monitor, first_nan=13, last=16, start=12)
    assert [a.severity for a in found] == ["warning", "critical"]
    assert [d.kind for d in second if d.kind == "rollback"] == []

    monitor.observe(
        ActionAckEvent(run_id="run-1", action_id=rollbacks[0].action_id, outcome="applied", ts=_at(17))
    )
    _, third = _run_nan(monitor, first_nan=19, last=22, start=18)
    again = [d for d in third if d.kind == "rollback"]
    assert len(again) == 1
    assert again[0].onset_step == 19 and again[0].target_checkpoint.step == 0
    assert again[0].action_id != rollbacks[0].action_id


def test_a_verified_recovery_is_an_info_finding_and_a_recovered_action_for_the_trainer():
    monitor = RunMonitor("run-1", RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}))
    monitor.observe(_ckpt(0))  # confirmed at step 6
    _, first = _run_nan(monitor, first_nan=8, last=11)
    (rollback,) = [d for d in first if d.kind == "rollback"]
    monitor.observe(_applied(rollback.action_id, to_step=0, t=11.5))
    # the replay from step 1 is healthy; judged 20 steps past the onset (step 8): at step 27
    anomalies, decisions = [], []
    for s in range(1, 40):
        out = monitor.observe(StepEvent(run_id="run-1", step=s, loss=1.0, ts=_at(12 + s), event_id=f"r{s}"))
        anomalies += out.anomalies
        decisions += out.decisions
    (verified,) = anomalies
    assert (verified.detector, verified.severity, verified.step) == ("recovered", "info", 27)
    assert verified.evidence["rolled_back_to"] == 0 and verified.evidence["action_id"] == rollback.action_id
    (recovered,) = decisions
    assert recovered.kind == "recovered" and recovered.anomaly_ids == [verified.anomaly_id]
    assert recovered.params["rollback_action_id"] == rollback.action_id
    assert recovered.params["rolled_back_to"] == 0 and recovered.reason == verified.message
    assert monitor.recovery is None  # judged once


def test_ack_of_another_action_does_not_release_the_pending_rollback():
    policy = ActionPolicy(PolicyConfig())
    first = policy.decide(_anomaly("a1"), _at(0), GOOD)
    assert first.kind == "rollback"
    policy.acknowledge("not-the-rollback")
    assert policy.decide(_anomaly("a2"), _at(1), GOOD) is None
    policy.acknowledge(first.action_id)
    assert policy.decide(_anomaly("a3"), _at(2), GOOD).kind == "rollback"


# -- ActionPolicy directly ------------------------------------------------------------------------


def test_default_rules_warning_alerts_and_info_is_ignored():
    policy = ActionPolicy(PolicyConfig())
    alert = policy.decide(_anomaly(severity="warning", step=10), _at(0))
    assert alert.kind == "alert" and alert.target_checkpoint is None
    assert policy.decide(_anomaly("an-2", detector="loss_spike", severity="info"), _at(1)) is None


def test_by_default_a_critical_spike_or_divergence_rolls_back_and_a_warning_spike_alerts():
    policy = ActionPolicy(PolicyConfig(cooldown_s=0))
    assert policy.decide(_anomaly("w", detector="loss_spike", severity="warning"), _at(0)).kind == "alert"
    assert (
        policy.decide(_anomaly("g", detector="grad_norm_spike", severity="warning"), _at(1)).kind == "alert"
    )
    decision = policy.decide(_anomaly("c", detector="loss_spike", severity="critical"), _at(2), GOOD)
    assert decision.kind == "rollback"
    assert policy.rolls_back_on("loss_spike") and policy.rolls_back_on("not_recovered")
    assert not policy.rolls_back_on("throughput_drift")


def test_alert_only_turns_every_action_into_an_alert():
    policy = ActionPolicy(PolicyConfig(alert_only=True, cooldown_s=0))
    assert policy.decide(_anomaly("n"), _at(0), GOOD).kind == "alert"
    assert (
        policy.decide(_anomaly("c", detector="loss_spike", severity="critical"), _at(1), GOOD).kind == "alert"
    )
    assert not policy.rolls_back_on("non_finite")


def test_after_the_cap_a_milder_return_of_the_fault_stops_the_run():
    policy = ActionPolicy(PolicyConfig(max_rollbacks=1, cooldown_s=0))
    first = policy.decide(_anomaly("c1", detector="loss_spike", severity="critical"), _at(0), GOOD)
    assert first.kind == "rollback"
    # still in flight from before the rollback: not judged
    assert policy.decide(_anomaly("w0", detector="loss_spike", severity="warning"), _at(1)) is None
    policy.acknowledge(first.action_id)
    # unrelated detectors still only alert
    assert (
        policy.decide(_anomaly("t", detector="throughput_drift", severity="warning"), _at(2)).kind == "alert"
    )
    stop = policy.decide(_anomaly("w1", detector="loss_spike", severity="warning"), _at(3))
    assert stop.kind == "stop" and stop.params["cause"] == "max_rollbacks"


def test_first_matching_rule_wins():
    rules = [
        PolicyRule(detector="loss_spike", min_severity="critical", action="pause"),
        PolicyRule(detector="*", min_severity="warning", action="alert"),
        PolicyRule(detector="loss_spike", min_severity="warning", action="stop"),
    ]
    policy = ActionPolicy(PolicyConfig(rules=rules, cooldown_s=0))
    assert policy.decide(_anomaly("a", detector="loss_spike", severity="critical"), _at(0)).kind == "pause"
    assert policy.decide(_anomaly("b", detector="loss_spike", severity="warning"), _at(1)).kind == "alert"
    assert (
        policy.decide(_anomaly("c", detector="grad_norm_spike", severity="critical"), _at(2)).kind == "alert"
    )


def test_rollback_target_is_the_checkpoint_passed_in():
    policy = ActionPolicy(PolicyConfig())
    ref = CheckpointRef(step=3, uri="/c/3")
    decision = policy.decide(_anomaly(), _at(0), checkpoint=ref)
    assert decision.target_checkpoint == ref and decision.onset_step == 10


def test_after_max_rollbacks_the_next_is_stop_and_then_nothing():
    policy = ActionPolicy(PolicyConfig(max_rollbacks=2))
    kinds = []
    for i in range(3):
        decision = policy.decide(_anomaly(f"nan-{i}", step=10 * i + 2, onset=10 * i), _at(10 * i), GOOD)
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
    assert (
        policy.decide(_anomaly("g1", detector="grad_norm_spike", severity="warning"), _at(31)).kind == "alert"
    )
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
        monitor = RunMonitor("run-1", RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}))
        monitor.observe(_ckpt(0))
        return _run_nan(monitor, first_nan=8, last=12)

    anomalies_a, decisions_a = replay()
    anomalies_b, decisions_b = replay()
    assert [a.anomaly_id for a in anomalies_a] == [a.anomaly_id for a in anomalies_b]
    assert [d.action_id for d in decisions_a] == [d.action_id for d in decisions_b]
    assert len(decisions_a) == 2


def test_pending_rollback_expires_after_action_ttl():
    policy = ActionPolicy(PolicyConfig(action_ttl_s=120))
    first = policy.decide(_anomaly("n1"), _at(0), GOOD)
    assert first.kind == "rollback"
    assert policy.rollback_pending(_at(100))
    assert policy.decide(_anomaly("n2"), _at(119), GOOD) is None
    assert not policy.rollback_pending(_at(121))
    second = policy.decide(_anomaly("n3"), _at(121), GOOD)
    assert second is not None and second.kind == "rollback"
    assert policy.rollbacks == 2


# -- LR scale, data window, cap, escalation -------------------------------------------------------


def test_rollback_lr_scale_is_cumulative():
    policy = ActionPolicy(PolicyConfig(lr_scale_on_rollback=0.5, max_rollbacks=3))
    scales = []
    for i in range(3):
        decision = policy.decide(_anomaly(f"nan-{i}", step=10 * i + 2, onset=10 * i), _at(10 * i), GOOD)
        assert decision.kind == "rollback"
        scales.append(decision.params["lr_scale"])
        assert decision.params["rollback_number"] == i + 1
        policy.acknowledge(decision.action_id)
    assert scales == [0.5, 0.25, 0.125]
    stop = policy.decide(_anomaly("nan-9", step=92, onset=90), _at(100))
    assert stop.kind == "stop" and stop.params == {"cause": "max_rollbacks", "rollbacks": 3}
    assert "rollback cap reached (3 rollbacks)" in stop.reason


def test_lr_scale_one_leaves_the_lr_alone():
    decision = ActionPolicy(PolicyConfig(lr_scale_on_rollback=1.0)).decide(_anomaly(), _at(0), GOOD)
    assert decision.params["lr_scale"] == 1.0


def test_skip_window_from_the_checkpoint_to_the_anomaly():
    policy = ActionPolicy(PolicyConfig(skip_data_window=True))
    decision = policy.decide(
        _anomaly(step=12, onset=10), _at(0), checkpoint=CheckpointRef(step=4, uri="/c/4")
    )
    assert decision.params["skip_steps"] == [5, 12]  # inclusive: the batches trained after the checkpoint
    policy.acknowledge(decision.action_id)
    other = policy.decide(_anomaly("an-2", step=30, onset=27), _at(10), CheckpointRef(step=20, uri="/c/20"))
    assert other.params["skip_steps"] == [21, 30]


def test_the_skip_window_is_on_by_default_and_can_be_turned_off():
    """Issue 37: by default the data goes on forward after a rollback (a batch-tied fault is not replayed)."""
    checkpoint = CheckpointRef(step=4, uri="/c")
    assert ActionPolicy(PolicyConfig()).decide(_anomaly(step=12), _at(0), checkpoint).params[
        "skip_steps"
    ] == [5, 12]
    decision = ActionPolicy(PolicyConfig(skip_data_window=False)).decide(_anomaly(), _at(0), checkpoint)
    assert "skip_steps" not in decision.params


def test_a_rollback_says_when_its_lr_scale_returns():
    decision = ActionPolicy(PolicyConfig()).decide(_anomaly(), _at(0), CheckpointRef(step=4, uri="/c"))
    assert (decision.params["lr_restore_after_steps"], decision.params["lr_restore_over_steps"]) == (500, 100)
    never = ActionPolicy(PolicyConfig(lr_restore_after_steps=None)).decide(_anomaly(), _at(0), GOOD)
    assert "lr_restore_after_steps" not in never.params


WARN = dict(detector="loss_spike", severity="warning")


def test_recurring_alert_escalates_to_stop_after_escalate_after_s():
    policy = ActionPolicy(PolicyConfig(cooldown_s=60, escalate_after_s=600))
    kinds = []
    for i, t in enumerate([0, 30, 200, 400, 430]):
        decision = policy.decide(_anomaly(f"s{i}", **WARN), _at(t))
        kinds.append(decision.kind if decision else None)
    assert kinds == [
        "alert",
        None,
        "alert",
        "alert",
        None,
    ]  # held back by the cooldown, yet they continue the episode
    stop = policy.decide(_anomaly("s5", **WARN), _at(600))
    assert stop.kind == "stop" and stop.params["cause"] == "escalation"
    assert stop.params["detector"] == "loss_spike" and stop.params["alerting_s"] == 600
    assert stop.anomaly_ids == ["s5"] and policy.stopped
    # deterministic id, like every other action
    again = ActionPolicy(PolicyConfig(cooldown_s=60, escalate_after_s=600))
    for i, t in enumerate([0, 30, 200, 400, 430, 600]):
        last = again.decide(_anomaly(f"s{i}", **WARN), _at(t))
    assert last.action_id == stop.action_id


def test_escalation_needs_the_condition_to_persist():
    policy = ActionPolicy(PolicyConfig(cooldown_s=60, escalate_after_s=600))
    assert policy.decide(_anomaly("a", **WARN), _at(0)).kind == "alert"
    # quiet for longer than escalate_after_s: cleared, a new episode starts with an alert
    assert policy.decide(_anomaly("b", **WARN), _at(700)).kind == "alert"
    assert policy.decide(_anomaly("c", **WARN), _at(1200)).kind == "alert"
    assert policy.decide(_anomaly("d", **WARN), _at(1300)).kind == "stop"  # 600 s after the alert at 700
    # another detector's alerts do not continue this one's episode
    other = ActionPolicy(PolicyConfig(cooldown_s=0, escalate_after_s=600))
    other.decide(_anomaly("x", **WARN), _at(0))
    assert (
        other.decide(_anomaly("y", detector="grad_norm_spike", severity="warning"), _at(650)).kind == "alert"
    )


def test_a_rollback_in_between_resets_escalation():
    policy = ActionPolicy(PolicyConfig(cooldown_s=0, escalate_after_s=600))
    policy.decide(_anomaly("w1", **WARN), _at(0))
    policy.decide(_anomaly("w2", **WARN), _at(300))
    rollback = policy.decide(_anomaly("nan"), _at(400), GOOD)
    assert rollback.kind == "rollback"
    assert policy.decide(_anomaly("w3", **WARN), _at(650)).kind == "alert"  # a new episode from 650
    assert policy.decide(_anomaly("w4", **WARN), _at(1249)).kind == "alert"
    assert policy.decide(_anomaly("w5", **WARN), _at(1250)).kind == "stop"


def test_escalation_off_with_zero():
    policy = ActionPolicy(PolicyConfig(cooldown_s=0, escalate_after_s=0))
    assert [policy.decide(_anomaly(f"a{t}", **WARN), _at(t)).kind for t in range(0, 5000, 100)] == [
        "alert"
    ] * 50
    assert policy.tick(_at(10_000)) == []


def _stall(anomaly_id: str, rank: int = 1) -> Anomaly:
    return Anomaly(
        anomaly_id=anomaly_id,
        run_id="run-1",
        step=50,
        rank=rank,
        detector="stall",
        metric="step_progress",
        severity="warning",
        message="stalled",
        evidence={"kind": "stalled"},
        ts=T0,
    )


def test_persisting_stall_escalates_on_tick_unless_the_rank_progresses():
    policy = ActionPolicy(PolicyConfig(escalate_after_s=600))
    assert policy.decide(_stall("st1"), _at(0)).kind == "alert"
    assert policy.tick(_at(599)) == []
    [stop] = policy.tick(_at(600))
    assert stop.kind == "stop" and stop.params["detector"] == "stall" and stop.anomaly_ids == ["st1"]
    assert policy.tick(_at(700)) == [] and policy.stopped

    moving = ActionPolicy(PolicyConfig(escalate_after_s=600))
    moving.decide(_stall("st1", rank=1), _at(0))
    moving.observe_progress(0)  # another rank's progress does not clear rank 1's stall
    moving.observe_progress(1)
    assert moving.tick(_at(900)) == []
    assert moving.decide(_stall("st2"), _at(1000)).kind == "alert"  # a new stall: a new episode


def test_a_stall_that_persists_escalates_to_stop_through_the_monitor_ticks():
    from datetime import UTC, datetime, timedelta

    from runwatch.contract.schema import HeartbeatEvent

    t0 = datetime(2026, 11, 21, 9, 0, tzinfo=UTC)
    config = RunwatchConfig.model_validate({"policy": {"escalate_after_s": 120}})
    monitor = RunMonitor("run-1", config)
    for s in range(30):  # a steady 1 s pace, heartbeats every 5 s
        monitor.observe(StepEvent(run_id="run-1", step=s, loss=1.0, ts=t0 + timedelta(seconds=s)))
        if s % 5 == 0:
            monitor.observe(HeartbeatEvent(run_id="run-1", step=s, ts=t0 + timedelta(seconds=s)))
    kinds = []
    for second in range(30, 400):  # the step stops; heartbeats go on
        now = t0 + timedelta(seconds=second)
        if second % 5 == 0:
            out = monitor.observe(HeartbeatEvent(run_id="run-1", step=29, ts=now))
            kinds += [d.kind for d in out.decisions]
        kinds += [d.kind for d in monitor.tick(now).decisions]
    assert kinds == ["alert", "stop"]  # alerted once at the stall, stopped when nothing changed


# -- one finding per onset across rollbacks ------------------------------------------------------------


def _lr_step(step: int, lr: float, t: float) -> StepEvent:
    return StepEvent(run_id="run-1", step=step, loss=1.0, lr=[lr], ts=_at(t), event_id=f"e{step}-{t}")


def test_a_replay_that_finds_the_same_onset_says_nothing_new_and_a_new_onset_is_a_new_finding():
    monitor = RunMonitor("run-1", RunwatchConfig())
    t = 0.0

    def run(steps, lr_of):
        nonlocal t
        issued, repeated = [], []
        for s in steps:
            t += 1
            out = monitor.observe(_lr_step(s, lr_of(s), t))
            issued += [a for a in out.anomalies if a.detector == "update_ratio"]
            repeated += [f for f in out.repeated if f.detector == "update_ratio"]
        return issued, repeated

    def bug_at_100(s):
        return 1e-1 if s >= 100 else 1e-3

    first, _ = run(range(0, 120), bug_at_100)
    assert [(a.step, a.onset_step) for a in first] == [(100, 100)]
    # the trainer rolls back to step 50 (no alert-level action to acknowledge: the step counter goes back)
    again, repeated = run(range(51, 120), bug_at_100)
    assert again == [] and [(f.step, f.onset_step) for f in repeated] == [(100, 100)]
    # later the LR collapses x1e-4 at step 300: a new onset, a new finding
    later, _ = run(range(120, 320), lambda s: 1e-1 if s < 300 else 1e-5)
    assert [(a.step, a.onset_step, a.evidence["direction"]) for a in later] == [(300, 300, "vanishing")]


def test_a_finding_the_policy_rolls_back_on_is_issued_again_at_the_same_onset():
    """A fault that strikes again at the same step after a rollback must count towards the cap."""
    monitor = RunMonitor("run-1", RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}))
    monitor.observe(_ckpt(0))
    first, decisions = _run_nan(monitor, first_nan=8, last=11)
    (rollback,) = [d for d in decisions if d.kind == "rollback"]
    monitor.observe(_applied(rollback.action_id, to_step=0, t=11.5))
    again = []
    for s in range(1, 12):  # replayed from step 1 (new events): NaN at step 8 again
        event = StepEvent(
            run_id="run-1", step=s, loss=math.nan if s >= 8 else 1.0, ts=_at(12 + s), event_id=f"r{s}"
        )
        again += monitor.observe(event).anomalies
    assert [(a.detector, a.onset_step) for a in first] == [(a.detector, a.onset_step) for a in again]
    assert [a.detector for a in again] == ["non_finite", "non_finite"]
