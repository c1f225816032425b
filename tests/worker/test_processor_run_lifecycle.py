"""Runs that end, start again or never end (issue 23), without Faust or a broker: a rank's steps after
run_end are still joined, a run started again gets a fresh monitor, a requeued job's new attempt is
watched as a fresh run (and its old attempt's events read again are not judged as it), and a silent run
or one past ``runs.max_runs`` is let go with a finding."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

import pytest

from runwatch.contract.schema import RunEndEvent, StepEvent
from runwatch.contract.signing import verify_action
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import PUBLIC
from tests.support.processor_events import SECRET, T0, WALL, step_json

# -- run_end, and a run started again under its id -------------------------------------------------


def test_a_rank_whose_last_steps_come_after_run_end_is_still_joined(proc):
    """run_end (rank 0) can overtake another rank's last steps on the partition: the run is kept for a
    join timeout, so they are joined; then it is let go, and a step still missing a rank is joined as
    partial, not dropped."""
    from runwatch.contract.schema import RunStartEvent

    def ev(e) -> bytes:
        return e.to_json()

    proc.process(ev(RunStartEvent(run_id="run-1", world_size=2, ts=T0)), key=b"run-1")
    joined = []
    for s in range(5):
        for rank in (0, 1):
            joined += proc.process(
                ev(StepEvent(run_id="run-1", rank=rank, step=s, loss=1.0, ts=T0 + timedelta(seconds=s))),
                key=b"run-1",
            ).joined
    # rank 0's last two steps and its run_end, then rank 1's step 5 only (its step 6 never comes)
    for s in (5, 6):
        proc.process(
            ev(StepEvent(run_id="run-1", rank=0, step=s, loss=1.0, ts=T0 + timedelta(seconds=s))),
            key=b"run-1",
        )
    proc.process(ev(RunEndEvent(run_id="run-1", rank=0, ts=T0 + timedelta(seconds=6.5))), key=b"run-1")
    joined += proc.process(
        ev(StepEvent(run_id="run-1", rank=1, step=5, loss=1.0, ts=T0 + timedelta(seconds=5))), key=b"run-1"
    ).joined
    assert [(j.step, j.complete) for j in joined] == [(s, True) for s in range(6)]
    assert "run-1" in proc.monitors
    assert proc.tick(WALL + timedelta(seconds=1)).anomalies == []  # an ended run is not judged stalled
    late = proc.tick(WALL + timedelta(seconds=60))  # a join timeout after run_end: let go
    assert [(j.step, j.complete, j.ranks_missing) for j in late.joined] == [(6, False, [1])]
    assert "run-1" not in proc.monitors


def test_a_run_started_again_under_its_id_right_after_run_end_gets_a_fresh_monitor(proc):
    from runwatch.contract.schema import RunStartEvent

    proc.process(RunStartEvent(run_id="run-1", world_size=2, ts=T0).to_json(), key=b"run-1")
    proc.process(RunEndEvent(run_id="run-1", ts=T0 + timedelta(seconds=1)).to_json(), key=b"run-1")
    ended = proc.monitors["run-1"]
    proc.process(
        RunStartEvent(run_id="run-1", world_size=4, ts=T0 + timedelta(seconds=2)).to_json(), key=b"run-1"
    )
    resumed = proc.monitors["run-1"]
    assert resumed is not ended and resumed.ended_at is None and resumed.join.world_size == 4


# -- issue 23, case 2: a requeued job is a new attempt, watched as a fresh run ---------------------


def _nan_attempt(proc, attempt: str | None, start: datetime) -> list:
    from runwatch.contract.schema import RunStartEvent

    actions = proc.process(RunStartEvent(run_id="rq", attempt=attempt, ts=start).to_json(), key=b"rq").actions
    for s in range(6):  # no checkpoint: the NaN streak ends in a stop
        actions += proc.process(
            StepEvent(run_id="rq", step=s, loss=math.nan, ts=start + timedelta(seconds=s)).to_json(),
            key=b"rq",
        ).actions
    return actions


def test_a_new_attempt_without_run_end_is_watched_fresh_and_its_actions_name_it(proc):
    first = _nan_attempt(proc, "a1", T0)
    assert [a.kind for a in first] == ["alert", "stop"] and {a.attempt for a in first} == {"a1"}
    # killed after the stop, no run_end; requeued under the same run id with a new attempt
    second = _nan_attempt(proc, "a2", T0 + timedelta(minutes=5))
    assert [a.kind for a in second] == ["alert", "stop"] and {a.attempt for a in second} == {"a2"}
    assert all(verify_action(a, PUBLIC) for a in second)
    assert not {a.action_id for a in first} & {a.action_id for a in second}


def test_the_same_attempt_starting_again_is_not_a_new_run(proc):
    from runwatch.contract.schema import RunStartEvent

    assert [a.kind for a in _nan_attempt(proc, "a1", T0)] == ["alert", "stop"]
    monitor = proc.monitors["rq"]
    # run_start delivered again (a spool replayed, a producer retry): the same attempt, the same run
    again = RunStartEvent(run_id="rq", attempt="a1", ts=T0 + timedelta(seconds=9)).to_json()
    assert proc.process(again, key=b"rq").actions == [] and proc.monitors["rq"] is monitor
    assert monitor.policy.stopped


def test_the_old_attempts_events_read_again_after_a_rebalance_are_not_judged_as_the_new_ones():
    """A rebalance that leaves the worker its partition seeks back to the committed offset: the old attempt's
    NaN streak, read again after the new attempt's run_start, must not give the new attempt a stop (the CI
    failure of test_ranks_of_a_requeued_slurm_job_without_rank_sync_refuse_the_old_stop)."""
    from runwatch.contract.schema import RunStartEvent

    proc = TelemetryProcessor(RunwatchConfig(), SECRET, clock=lambda: WALL)
    old = [RunStartEvent(run_id="rq", attempt="a1", ts=T0).to_json()]
    old += [
        StepEvent(run_id="rq", step=s, loss=math.nan, ts=T0 + timedelta(seconds=s)).to_json()
        for s in range(6)
    ]
    first = [a for offset, raw in enumerate(old) for a in proc.process(raw, b"rq", 0, offset).actions]
    assert [(a.kind, a.attempt) for a in first] == [("alert", "a1"), ("stop", "a1")]
    start = RunStartEvent(run_id="rq", attempt="a2", ts=T0 + timedelta(minutes=5)).to_json()
    assert proc.process(start, b"rq", 0, len(old)).actions == []
    again = [a for offset, raw in enumerate(old) for a in proc.process(raw, b"rq", 0, offset).actions]
    assert again == [] and proc.counters.replay_skipped == len(old)
    assert proc.monitors["rq"].attempt == "a2" and proc.monitors["rq"].last_step is None
    # the new attempt's own events are judged
    late = StepEvent(run_id="rq", step=0, loss=math.nan, ts=T0 + timedelta(minutes=5, seconds=1)).to_json()
    assert [a.kind for a in proc.process(late, b"rq", 0, len(old) + 1).actions] == ["alert"]


# -- issue 23, case 4: runs that never end are let go -------------------------------------------------


def test_a_run_silent_past_the_retention_is_let_go_with_a_finding_but_not_while_its_partition_lags():
    wall = [WALL]
    config = RunwatchConfig.model_validate({"runs": {"silence_retention_s": 600}})
    proc = TelemetryProcessor(config, SECRET, clock=lambda: wall[0])
    proc.process(step_json(0, run_id="quiet"), key=b"quiet", partition=1)
    wall[0] = WALL + timedelta(seconds=300)
    proc.process(step_json(1, run_id="talks"), key=b"talks", partition=2)
    later = WALL + timedelta(seconds=601)
    # its events may be waiting
    assert proc.tick(later, behind={1}).anomalies == [] and "quiet" in proc.monitors
    (finding,) = proc.tick(later).anomalies
    assert (finding.run_id, finding.detector, finding.metric, finding.severity) == (
        "quiet",
        "run_lifecycle",
        "silent",
        "info",
    )
    assert finding.step == 0 and "went silent" in finding.message and finding.value == pytest.approx(601)
    assert set(proc.monitors) == {"talks"} and proc.counters.runs_let_go["silent"] == 1
    assert proc.tick(later + timedelta(seconds=1)).anomalies == []  # said once
    # an event of it later: watched afresh
    assert proc.process(step_json(2, run_id="quiet"), key=b"quiet", partition=1).deadletter is None
    assert "quiet" in proc.monitors


def test_past_max_runs_the_least_recently_active_run_is_let_go_with_a_finding():
    config = RunwatchConfig.model_validate({"runs": {"max_runs": 3}})
    proc = TelemetryProcessor(config, SECRET, clock=lambda: WALL)
    for run in ("r1", "r2", "r3"):
        proc.process(step_json(0, run_id=run), key=run.encode())
    proc.process(step_json(1, run_id="r1"), key=b"r1")  # r1 active again: r2 is now the least recent
    result = proc.process(step_json(0, run_id="r4"), key=b"r4")
    (finding,) = result.anomalies
    assert (finding.run_id, finding.metric, finding.severity) == ("r2", "evicted", "info")
    assert "limit of 3 runs" in finding.message
    assert set(proc.monitors) == {"r1", "r3", "r4"} and proc.counters.runs_let_go["evicted"] == 1
