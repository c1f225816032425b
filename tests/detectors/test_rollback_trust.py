"""A rollback you can trust, piece by piece: which checkpoints are confirmed good and which one a
rollback restores; a spike that recovers versus one that diverges; the recovery check after a
rollback; the LR a rollback sets (the run's own, recorded with the checkpoint); the config's
guards. The whole loop on real training is in tests/worker/test_trusted_rollback.py."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
import torch

from runwatch.contract.schema import (
    ActionAckEvent,
    CheckpointEvent,
    CheckpointRef,
    RunStartEvent,
    StepEvent,
)
from runwatch.detectors.config import ConfigError, RecoveryConfig, RunwatchConfig, SpikeConfig
from runwatch.detectors.engine.checkpoints import CheckpointLedger
from runwatch.detectors.engine.monitor import RunMonitor
from runwatch.detectors.engine.recovery import RecoveryCheck
from runwatch.detectors.spike import SpikeDetector
from runwatch.producer.publish.lr import LR_SCALE_KEY, base_lrs, restore_base_lr

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)


def ref(step: int) -> CheckpointRef:
    return CheckpointRef(step=step, uri=f"/c/{step}")


# -- the ledger ---------------------------------------------------------------------------------


def test_a_checkpoint_is_good_only_after_its_healthy_steps():
    ledger = CheckpointLedger(confirm_steps=20)
    ledger.register(ref(100))
    assert ledger.observe_step(119) == [] and ledger.target(None) is None
    assert ledger.observe_step(120) == [ref(100)] and ledger.target(None) == ref(100)


def test_a_finding_rejects_the_pending_and_the_ones_that_may_hold_the_fault():
    ledger = CheckpointLedger(confirm_steps=20)
    for step in (100, 150, 180, 200):
        ledger.register(ref(step))
    ledger.observe_step(200)  # 100, 150 and 180 confirmed; 200 pending
    # the loss of 181 is the first computed with step 180's update: 180 may hold the fault
    ledger.reject_for(181)
    assert [c.step for c in ledger.good] == [100, 150] and ledger.pending == []
    assert ledger.observe_step(260) == []  # a rejected checkpoint never comes back
    assert ledger.target(181) == ref(150)


def test_the_target_is_before_the_update_that_caused_the_onset():
    ledger = CheckpointLedger(confirm_steps=1)
    for step in (10, 20, 30):
        ledger.register(ref(step))
    ledger.observe_step(40)
    assert ledger.target(32) == ref(30)
    assert ledger.target(31) == ref(20)  # 30's update made the loss of 31: 30 holds it
    assert ledger.target(11) is None and ledger.target(None) == ref(30)


def test_after_a_rollback_later_checkpoints_are_gone_and_a_replayed_one_replaces():
    ledger = CheckpointLedger(confirm_steps=5)
    for step in (10, 20, 30):
        ledger.register(ref(step))
    ledger.observe_step(31)
    ledger.rolled_back(20)
    assert [c.step for c in ledger.good] == [10, 20]
    again = CheckpointRef(step=20, uri="/c/20-replayed")
    ledger.register(again)
    assert [c.step for c in ledger.good] == [10] and ledger.pending == [again]
    assert ledger.observe_step(30, hold=True) == []  # a recovery not yet verified: nothing confirmed
    assert ledger.observe_step(30) == [again]


# -- spike: transient or diverging --------------------------------------------------------------


def _series(values, detector):
    return [(s, f) for s, v in enumerate(values) if (f := detector.update(v, s)) is not None]


def test_a_transient_spike_is_one_warning_and_a_divergence_a_critical_finding_naming_its_onset():
    base = [1.0 + 0.02 * math.sin(i) for i in range(60)]
    transient = _series(base + [4.0] + base[:10], SpikeDetector("loss_spike", "loss", SpikeConfig()))
    assert [(s, f.severity, f.evidence["kind"]) for s, f in transient] == [(60, "warning", "spike")]

    diverging = _series(
        base + [4.0, 3.0, 2.5, 3.5, 2.8, 3.2, 3.0], SpikeDetector("loss_spike", "loss", SpikeConfig())
    )
    assert [(s, f.severity, f.evidence["kind"]) for s, f in diverging] == [
        (60, "warning", "spike"),
        (65, "critical", "divergence"),
    ]
    divergence = diverging[1][1]
    assert divergence.evidence["onset_step"] == 60 and divergence.evidence["ratio"] > 2.5


def test_a_huge_spike_is_critical_at_once_and_a_replay_from_before_it_cancels_the_watch():
    base = [1.0 + 0.02 * math.sin(i) for i in range(60)]
    huge = _series(base + [40.0], SpikeDetector("loss_spike", "loss", SpikeConfig()))
    assert [(s, f.severity) for s, f in huge] == [(60, "critical")]

    detector = SpikeDetector("loss_spike", "loss", SpikeConfig())
    for s, v in enumerate(base + [4.0, 3.0]):
        detector.update(v, s)
    # a rollback to step 50: the replayed steps are healthy and nothing is said about the old spike
    assert [detector.update(1.0, s) for s in range(51, 60)] == [None] * 9


# -- the recovery check -------------------------------------------------------------------------


HEALTHY = {s: 1.0 + 0.02 * math.sin(s) for s in range(150, 201)}


def test_a_run_back_at_its_pre_fault_loss_is_recovered():
    check = RecoveryCheck(RecoveryConfig(), "a1", onset_step=201, healthy=HEALTHY)
    assert check.update(181, 1.0) is None  # not armed: no ack yet
    check.arm(180)
    found = [(s, f) for s in range(181, 230) if (f := check.update(s, 1.0 + 0.02 * math.sin(s))) is not None]
    # judged once, 20 steps past the onset: an info finding (not an alarm) that says the rollback worked
    [(step, finding)] = found
    assert step == 220 and check.done
    assert finding.detector == "recovered" and finding.severity == "info"
    assert finding.value == pytest.approx(1.0, abs=0.03) and finding.value <= finding.threshold
    assert finding.evidence["rolled_back_to"] == 180 and finding.evidence["fault_onset_step"] == 201
    assert "onset_step" not in finding.evidence  # no fault starts here: nothing for the policy to roll back
    assert "recovered after the rollback to step 180" in finding.message


def test_a_run_that_stays_worse_past_the_onset_is_not_recovered():
    check = RecoveryCheck(RecoveryConfig(), "a1", onset_step=201, healthy=HEALTHY)
    check.arm(180)
    found = [(s, f) for s in range(181, 230) if (f := check.update(s, 1.0 if s <= 200 else 1.6)) is not None]
    # judged 20 steps past the onset, not 20 steps after the rollback (the replay before it is healthy)
    [(step, finding)] = found
    assert step == 220 and finding.detector == "not_recovered" and finding.severity == "critical"
    assert finding.value == pytest.approx(1.6, rel=0.05) and finding.value > finding.threshold
    assert finding.evidence["onset_step"] == 181 and finding.evidence["rolled_back_to"] == 180
    assert finding.evidence["fault_onset_step"] == 201


def test_after_a_failed_recovery_the_next_one_is_still_judged_past_the_fault():
    check = RecoveryCheck(
        RecoveryConfig(),
        "a2",
        onset_step=161,
        healthy=HEALTHY | {s: 1.0 for s in range(140, 150)},
        fault_onset_step=201,
    )
    check.arm(160)
    assert check.onset_step == 201 and max(check.reference) == 160
    assert [check.update(s, 1.0) for s in range(161, 220)] == [None] * 59
    verdict = check.update(220, math.nan)  # judged on the median of the last 5: one NaN does not sink it
    assert verdict is not None and verdict.detector == "recovered" and check.done


# -- the LR a rollback sets ---------------------------------------------------------------------


def test_base_lrs_and_restore_base_lr_use_the_runs_own_lr():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.02}])
    assert base_lrs(opt) == [0.1, 0.02] and base_lrs(None) is None
    for group in opt.param_groups:
        group["lr"] *= 50  # the fault, saved in the optimizer state
    assert restore_base_lr(opt, 0.5, base=[0.1, 0.02]) == pytest.approx(0.01)  # x1/50 x0.5 of the fault's
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.02])
    assert all(g[LR_SCALE_KEY] == 1.0 for g in opt.param_groups)
    # an optimizer state of an older runwatch, with its scale written into the LR: the base is without it
    for group in opt.param_groups:
        group["lr"], group[LR_SCALE_KEY] = group["lr"] * 0.5, 0.5
    assert base_lrs(opt) == pytest.approx([0.1, 0.02])
    restore_base_lr(opt, 0.25)  # no record: relative to the scale the state carries
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.02])


# -- the monitor: checkpoints, acks and the recovery together -------------------------------------


def _step(step: int, loss: float, n: int) -> StepEvent:
    return StepEvent(
        run_id="r", step=step, loss=loss, grad_norm=1.0, ts=T0 + timedelta(seconds=n), event_id=f"e{n}"
    )


def test_the_monitor_rolls_back_to_a_confirmed_checkpoint_then_again_when_the_run_does_not_recover():
    monitor = RunMonitor("r", RunwatchConfig())
    n = 0
    decisions = []

    def feed(steps, loss_of):
        nonlocal n
        for s in steps:
            n += 1
            decisions.extend(monitor.observe(_step(s, loss_of(s), n)).decisions)
            if s % 20 == 0:
                monitor.observe(
                    CheckpointEvent(run_id="r", step=s, uri=f"/c/{s}", lr=[0.1], ts=T0 + timedelta(seconds=n))
                )

    feed(range(0, 201), lambda s: 1.0 + 0.02 * math.sin(s))
    feed(range(201, 212), lambda s: 50.0)  # the loss explodes at 201 and stays there
    rollbacks = [d for d in decisions if d.kind == "rollback"]
    assert len(rollbacks) == 1
    first = rollbacks[0]
    assert first.target_checkpoint == CheckpointRef(step=180, uri="/c/180", lr=[0.1])  # 200 holds the fault
    monitor.observe(
        ActionAckEvent(
            run_id="r",
            action_id=first.action_id,
            action_kind="rollback",
            outcome="applied",
            to_step=180,
            ts=T0 + timedelta(seconds=n + 1),
        )
    )
    assert [c.step for c in monitor.checkpoints.good] == [20 * i for i in range(10)]  # nothing after 180
    feed(range(181, 222), lambda s: 1.0 if s <= 200 else 1.8)  # back, then worse without a spike
    missed = [d for d in decisions if d.kind == "rollback"][1:]
    assert len(missed) == 1 and missed[0].target_checkpoint.step == 160  # 180 did not bring it back
    assert missed[0].params["lr_scale"] == 0.25


def test_confirmation_must_outlast_the_divergence_wait():
    with pytest.raises(ValueError, match="confirm_steps"):
        RunwatchConfig.model_validate({"policy": {"confirm_steps": 5}})
    RunwatchConfig.model_validate(
        {
            "policy": {"confirm_steps": 3},
            "detectors": {"loss_spike": {"divergence_steps": 0}, "grad_norm_spike": {"divergence_steps": 2}},
        }
    )
    with pytest.raises(ValueError, match="judged_over"):
        RecoveryConfig(within_steps=3, judged_over=5)
    assert issubclass(ConfigError, Exception)


# -- many ranks: a rollback is settled once every rank has acknowledged it -----------------------

MULTI_RANK = {
    "detectors": {"loss_spike": {"divergence_steps": 0}, "grad_norm_spike": {"divergence_steps": 0}},
    "policy": {
        "rules": [{"detector": "grad_norm_spike", "min_severity": "warning", "action": "rollback"}],
        "max_rollbacks": 3,
        "confirm_steps": 3,
        "cooldown_s": 0.0,
    },
}


class _ThreeRanks:
    """Feeds a 3-rank run's events in a chosen order, one second of event time apart."""

    def __init__(self):
        self.monitor = RunMonitor("r", RunwatchConfig.model_validate(MULTI_RANK))
        self.n = 0
        self.decisions = []
        self.anomaly_steps: list[int] = []
        self._observe(RunStartEvent(run_id="r", world_size=3, ts=self._ts(), event_id="start"))

    def _ts(self):
        self.n += 1
        return T0 + timedelta(seconds=self.n)

    def _observe(self, event):
        out = self.monitor.observe(event)
        self.decisions.extend(out.decisions)
        self.anomaly_steps.extend(a.step for a in out.anomalies)

    def step(self, rank: int, step: int, grad_norm: float, generation: int = 0):
        self._observe(
            StepEvent(
                run_id="r",
                rank=rank,
                step=step,
                loss=1.0,
                ts=self._ts(),
                grad_norm=grad_norm * (1 + 0.01 * math.sin(step)),
                event_id=f"s{generation}-{rank}-{step}",
            )
        )
        if rank == 0 and step % 10 == 0:
            self._observe(
                CheckpointEvent(
                    run_id="r",
                    rank=0,
                    step=step,
                    uri=f"/c/{step}",
                    lr=[0.1],
                    ts=self._ts(),
                    event_id=f"c{generation}-{step}",
                )
            )

    def steps(self, ranks, steps, grad_norm=lambda s: 1.0, generation: int = 0):
        for s in steps:
            for rank in ranks:
                self.step(rank, s, grad_norm(s), generation)

    def ack(self, rank: int, action_id: str, to_step: int):
        self._observe(
            ActionAckEvent(
                run_id="r",
                rank=rank,
                action_id=action_id,
                action_kind="rollback",
                outcome="applied",
                to_step=to_step,
                ts=self._ts(),
                event_id=f"ack-{rank}-{action_id}",
            )
        )

    def rollbacks(self):
        return [d for d in self.decisions if d.kind == "rollback"]


def _exploded(onset: int):
    return lambda s: 1e5 if s >= onset else 1.0


def test_a_ranks_steps_from_before_the_rollback_arriving_after_another_ranks_ack_are_not_judged_again():
    run = _ThreeRanks()
    run.steps(range(3), range(0, 35))
    # the explosion at 35: rank 0 is ahead (36, 37 sent), ranks 1 and 2 report 35, the joined 35 rolls back
    run.steps([0], range(35, 38), _exploded(35))
    run.steps([1, 2], [35], _exploded(35))
    (rollback,) = run.rollbacks()
    assert rollback.target_checkpoint.step == 30
    # rank 0 applies it first; ranks 1 and 2 publish more slowly: their 36 and 37 (still exploded, and
    # completing the joined 36 and 37) arrive after rank 0's acknowledgement, then their own
    run.ack(0, rollback.action_id, 30)
    judged_before = len(run.anomaly_steps)
    run.steps([1, 2], [36, 37], _exploded(35))
    assert run.anomaly_steps[judged_before:] == []  # kept out of the rewound detectors: no finding ...
    run.ack(1, rollback.action_id, 30)
    run.ack(2, rollback.action_id, 30)
    run.steps(range(3), range(31, 60), generation=1)  # the healthy replay
    assert len(run.rollbacks()) == 1  # ... and no second rollback
    # once every rank has acknowledged, the policy is free again: a new fault rolls back
    run.steps(range(3), range(60, 64), _exploded(60), generation=1)
    assert len(run.rollbacks()) == 2 and run.rollbacks()[1].target_checkpoint.step < 60


def test_a_rank_that_never_acknowledges_holds_the_next_rollback_only_until_the_action_expires():
    run = _ThreeRanks()
    run.steps(range(3), range(0, 35))
    run.steps(range(3), [35], _exploded(35))
    (rollback,) = run.rollbacks()
    run.ack(0, rollback.action_id, 30)
    run.ack(1, rollback.action_id, 30)  # rank 2 never acknowledges (its listener is gone)
    run.steps([0, 1], range(31, 45), generation=1)  # rank 2 silent: the join times out without it
    run.n += int(RunwatchConfig().policy.action_ttl_s) + 1
    run.steps([0, 1], range(45, 60), generation=1)
    run.steps([0, 1], range(60, 64), _exploded(60), generation=1)
    assert len(run.rollbacks()) == 2  # the rollback expired unsettled: a new fault still rolls back


def test_a_loop_whose_step_counter_goes_on_after_a_rollback_is_still_judged():
    """Some loops restore a checkpoint but keep counting steps up (no new generation): the steps after
    the acknowledgement are the replay's, judged as ever, and a new fault there rolls back again."""
    run = _ThreeRanks()
    run.steps(range(3), range(0, 35))
    run.steps(range(3), [35], _exploded(35))
    (rollback,) = run.rollbacks()
    for rank in range(3):
        run.ack(rank, rollback.action_id, 30)
    judged_before = len(run.anomaly_steps)
    run.steps(range(3), range(36, 60))  # healthy, counting on from 36
    run.steps(range(3), range(60, 64), _exploded(60))
    assert len(run.rollbacks()) == 2
    assert any(step >= 60 for step in run.anomaly_steps[judged_before:])
