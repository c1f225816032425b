"""The worker's per-message logic, without Faust or a broker. A bad message must become a dead letter
with a reason (and must not stop the stream); a NaN run must yield a signed rollback the trainer will
accept, expiring ``action_ttl_s`` after issue; run_end must free the run's state."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import CheckpointEvent, CheckpointRef, RunEndEvent, StepEvent
from runwatch.contract.signing import ActionSigningKey, verify_action
from runwatch.contract.topics import TELEMETRY
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import PUBLIC, SEED

SECRET = SEED  # the workers' signing key
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
# The worker's wall clock: events without a record time are checked against it (within 7 days before it)
WALL = T0 + timedelta(hours=6)

# The fields every telemetry event must carry, minus run_id and kind (which tests vary).
HEAD = b'{"schema_version":1,"event_id":"e","rank":0,"ts":"2024-05-01T12:00:00Z",'


@pytest.fixture
def proc() -> TelemetryProcessor:
    # checkpoints confirmed after 6 healthy steps, so short test runs have a rollback target
    return TelemetryProcessor(
        RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}), SECRET, clock=lambda: WALL
    )


def _step(step: int, loss: float = 1.0, run_id: str = "run-1") -> bytes:
    return StepEvent(run_id=run_id, step=step, loss=loss, ts=T0 + timedelta(seconds=step)).to_json()


@pytest.mark.integration  # starts a process
def test_importing_the_processor_needs_no_broker_or_faust():
    code = (
        "import sys, runwatch.worker.processor as p; "
        "print(sorted(m for m in ('faust', 'kafka', 'aiokafka', 'clickhouse_connect') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "raw, reason_start, reason_has",
    [
        (b"\x00\x01 definitely not json", "not JSON", ""),
        (HEAD + b'"kind":"step","run_id":"run-1"}', "schema:", "step"),
        (HEAD + b'"kind":"step","run_id":"run-1","step":"abc"}', "schema:", "step"),
        (HEAD + b'"kind":"step","step":3}', "schema:", "run_id"),
        (HEAD + b'"kind":"nope","run_id":"run-1"}', "schema:", "nope"),
        (b"[1,2,3]", "schema:", "object"),
    ],
)
def test_malformed_message_is_dead_lettered_and_the_stream_goes_on(proc, raw, reason_start, reason_has):
    result = proc.process(raw, key=b"run-1", partition=2, offset=41)
    dl = result.deadletter
    assert dl is not None
    assert dl.reason.startswith(reason_start) and reason_has in dl.reason
    assert dl.source_topic == TELEMETRY
    assert (dl.partition, dl.offset, dl.key) == (2, 41, "run-1")
    assert dl.raw == raw.decode(errors="replace")
    assert result.anomalies == [] and result.actions == []
    assert proc.counters.deadlettered == 1
    assert proc.counters.processed == 0
    assert proc.monitors == {}

    ok = proc.process(_step(0), key=b"run-1", partition=2, offset=42)
    assert ok.deadletter is None
    assert proc.counters.processed == 1
    assert proc.counters.deadlettered == 1
    assert "run-1" in proc.monitors


def test_key_not_matching_run_id_is_dead_lettered(proc):
    result = proc.process(_step(0, run_id="run-1"), key=b"run-2", partition=0, offset=7)
    assert result.deadletter is not None
    assert "run-2" in result.deadletter.reason and "run-1" in result.deadletter.reason
    assert proc.counters.deadlettered == 1
    assert "run-1" not in proc.monitors  # the wrong partition must not grow state for the run


def test_deadletter_is_itself_valid_wire_json(proc):
    dl = proc.process(b"\xff\xfe not utf8", key=None).deadletter
    data = json.loads(dl.to_json())
    assert data["reason"].startswith("not JSON")
    assert data["source_topic"] == TELEMETRY
    assert "key" not in data


def test_deadletters_are_counted(proc):
    for i in range(5):
        proc.process(b"garbage", offset=i)
    proc.process(_step(0), key=b"run-1")
    proc.process(b"{}", offset=6)
    assert proc.counters.deadlettered == 6
    assert proc.counters.processed == 1


def _nan_run(proc: TelemetryProcessor):
    results = []
    for s in range(12):
        if s == 1:
            ckpt = CheckpointEvent(run_id="run-1", step=1, uri="/ckpt/1.pt", ts=T0 + timedelta(seconds=s))
            results.append(proc.process(ckpt.to_json(), key=b"run-1"))
        results.append(proc.process(_step(s, loss=math.nan if s >= 8 else 1.0), key=b"run-1"))
    return results


def test_nan_run_yields_a_signed_rollback(proc):
    results = _nan_run(proc)
    assert all(r.deadletter is None for r in results)
    actions = [a for r in results for a in r.actions]
    anomalies = [a for r in results for a in r.anomalies]
    assert [(a.step, a.severity, a.detector) for a in anomalies] == [
        (8, "warning", "non_finite"),
        (10, "critical", "non_finite"),
    ]
    assert [a.kind for a in actions] == ["alert", "rollback"]
    rollback = actions[1]
    assert rollback.run_id == "run-1"
    assert rollback.onset_step == 8
    assert rollback.target_checkpoint == CheckpointRef(step=1, uri="/ckpt/1.pt")  # confirmed at step 7
    assert rollback.anomaly_ids == [anomalies[1].anomaly_id]

    assert verify_action(rollback, PUBLIC)
    assert not verify_action(rollback, ActionSigningKey.generate().public)
    assert rollback.issued_at == WALL
    assert rollback.expires_at - rollback.issued_at == timedelta(seconds=proc.config.policy.action_ttl_s)
    assert not rollback.is_expired(WALL)

    assert proc.counters.anomalies == 2
    assert proc.counters.actions == {"alert": 1, "rollback": 1}
    assert proc.counters.processed == 13


def test_actions_use_the_configured_ttl():
    cfg = RunwatchConfig.model_validate({"policy": {"action_ttl_s": 7.5}})
    proc = TelemetryProcessor(cfg, SECRET, clock=lambda: WALL)
    actions = [a for r in _nan_run(proc) for a in r.actions]
    assert actions and all(a.expires_at - a.issued_at == timedelta(seconds=7.5) for a in actions)


def test_reprocessing_the_same_bytes_gives_the_same_ids():
    raws = [_step(s, loss=math.nan if s >= 3 else 1.0) for s in range(8)]

    def run():
        p = TelemetryProcessor(RunwatchConfig(), SECRET, clock=lambda: WALL)
        results = [p.process(r, key=b"run-1") for r in raws]
        return (
            [a.anomaly_id for r in results for a in r.anomalies],
            [a.action_id for r in results for a in r.actions],
        )

    assert run() == run()
    assert len(run()[1]) == 2


def test_run_end_removes_the_runs_monitor(proc):
    proc.process(_step(0, run_id="run-1"), key=b"run-1")
    proc.process(_step(0, run_id="run-2"), key=b"run-2")
    assert set(proc.monitors) == {"run-1", "run-2"}
    end = proc.process(RunEndEvent(run_id="run-1", status="completed", ts=T0).to_json(), key=b"run-1")
    assert end.deadletter is None
    assert set(proc.monitors) == {"run-2"}


def test_runs_are_independent(proc):
    for s in range(6):
        proc.process(_step(s, loss=math.nan, run_id="bad"), key=b"bad")
        out = proc.process(_step(s, loss=1.0, run_id="good"), key=b"good")
        assert out.anomalies == [] and out.actions == []
    assert not proc.monitors["good"].policy.stopped
    assert proc.monitors["bad"].policy.stopped  # no checkpoint to restore: stopped


def test_tick_runs_time_based_checks_for_every_held_run(monkeypatch):
    from runwatch.detectors.engine import monitor as monitor_module
    from runwatch.detectors.findings import Finding

    class FiresOnTick:
        name = "fires_on_tick"

        def update(self, event, now):
            return []

        def tick(self, now):
            return [Finding(detector="stall", metric="step", step=3, severity="warning", message="stalled")]

    monkeypatch.setattr(
        monitor_module,
        "build_detectors",
        lambda config, names, progress: [FiresOnTick()] if names == monitor_module.RANK_VIEW else [],
    )
    processor = TelemetryProcessor(RunwatchConfig(), SECRET)
    for run in ("run-a", "run-b"):
        processor.process(StepEvent(run_id=run, step=3).to_json(), run.encode())
    result = processor.tick(datetime(2026, 11, 21, 10, 0, tzinfo=UTC))
    assert sorted(a.run_id for a in result.anomalies) == ["run-a", "run-b"]
    assert [a.kind for a in result.actions] == ["alert", "alert"]  # the default policy alerts on warnings
    assert all(a.signature for a in result.actions)


def _record_ticks(monkeypatch) -> list:
    """Every run's rank view gets one detector that notes the times it is ticked at; returns that list."""
    from runwatch.detectors.engine import monitor as monitor_module

    ticked: list = []

    class RecordsTicks:
        name = "records_ticks"

        def update(self, event, now):
            return []

        def tick(self, now):
            ticked.append(now)
            return []

    monkeypatch.setattr(
        monitor_module,
        "build_detectors",
        lambda config, names, progress: [RecordsTicks()] if names == monitor_module.RANK_VIEW else [],
    )
    return ticked


def test_tick_judges_each_run_on_its_event_time_carried_forward_by_the_wall_clock(monkeypatch):
    ticked = _record_ticks(monkeypatch)
    wall = [datetime(2026, 11, 21, 12, 0, tzinfo=UTC)]
    processor = TelemetryProcessor(RunwatchConfig(), SECRET, clock=lambda: wall[0])
    sent = datetime(2026, 11, 21, 9, 0, tzinfo=UTC)  # a backlog from three hours ago, read now
    processor.process(StepEvent(run_id="old", step=7, ts=sent).to_json(), b"old")
    wall[0] += timedelta(seconds=10)
    processor.tick()
    assert ticked == [sent + timedelta(seconds=10)]  # not 3 h of silence: 10 s since that event arrived


def test_a_run_whose_partition_the_worker_is_behind_on_is_not_carried_forward(monkeypatch):
    ticked = _record_ticks(monkeypatch)
    wall = [datetime(2026, 11, 21, 12, 0, tzinfo=UTC)]
    processor = TelemetryProcessor(RunwatchConfig(), SECRET, clock=lambda: wall[0])
    processor.process(StepEvent(run_id="r", step=7, ts=wall[0]).to_json(), b"r", partition=2)
    wall[0] += timedelta(seconds=10)  # ten seconds in which the worker read nothing of partition 2
    processor.tick(behind={2})
    processor.tick(behind={0, 1})
    # behind on its partition: judged at its newest event (the broker holds later ones); else carried on
    assert ticked == [wall[0] - timedelta(seconds=10), wall[0]]


def test_a_rebalance_drops_only_the_runs_of_partitions_this_worker_lost(proc):
    proc.process(_step(0, run_id="stays"), key=b"stays", partition=1)
    proc.process(_step(0, run_id="moves"), key=b"moves", partition=3)
    assert proc.keep_partitions({0, 1}) == ["moves"]
    assert set(proc.monitors) == {"stays"}
    assert proc.tick().anomalies == []  # the timer no longer judges the run it gave away


def test_multi_rank_steps_come_out_joined(proc):
    from runwatch.contract.schema import RunStartEvent

    proc.process(RunStartEvent(run_id="dist", world_size=2, ts=T0).to_json(), key=b"dist")
    first = proc.process(
        StepEvent(run_id="dist", rank=0, step=0, grad_norm=3.0, grad_sharded=True, ts=T0).to_json(),
        key=b"dist",
    )
    assert first.joined == []
    second = proc.process(
        StepEvent(run_id="dist", rank=1, step=0, grad_norm=4.0, grad_sharded=True, ts=T0).to_json(),
        key=b"dist",
    )
    (joined,) = second.joined
    assert joined.grad_norm == pytest.approx(5.0) and joined.ranks_reported == [0, 1]


def test_actions_carry_the_runs_job_id_for_remediation(proc):
    from runwatch.contract.schema import RunStartEvent

    proc.process(
        RunStartEvent(
            run_id="job-run", job_id="81234", host="node7", tags={"pod": "trainer-0"}, ts=T0
        ).to_json(),
        key=b"job-run",
    )
    actions = []
    for s in range(5):
        actions += proc.process(_step(s, loss=math.nan, run_id="job-run"), key=b"job-run").actions
    assert actions
    assert all(
        a.params["job_id"] == "81234" and a.params["host"] == "node7" and a.params["pod"] == "trainer-0"
        for a in actions
    )
    assert all(verify_action(a, ActionSigningKey.from_seed(proc._secret).public) for a in actions)


# -- isolation: one run's failure is that run's alone ---------------------------------------------


def _explode_on(monkeypatch, run_id: str, step: int) -> None:
    """A detector bug: the monitor raises on one step of one run (and only there)."""
    from runwatch.detectors.engine.monitor import RunMonitor

    original = RunMonitor.observe

    def observe(self, event):
        if self.run_id == run_id and getattr(event, "step", None) == step:
            raise ZeroDivisionError("a detector divided by zero")
        return original(self, event)

    monkeypatch.setattr(RunMonitor, "observe", observe)


def test_a_detector_error_resets_only_its_run_and_is_dead_lettered_with_the_traceback(proc, monkeypatch):
    _explode_on(monkeypatch, "bad-run", 5)
    for s in range(5):
        assert proc.process(_step(s, run_id="bad-run"), key=b"bad-run").errors == []
        proc.process(_step(s, run_id="good-run"), key=b"good-run")
    result = proc.process(_step(5, run_id="bad-run"), key=b"bad-run", partition=3, offset=77)
    [letter] = result.errors
    assert letter.stage == "detector" and letter.reason.startswith("detector_error: ZeroDivisionError")
    assert "a detector divided by zero" in letter.traceback and (letter.partition, letter.offset) == (3, 77)
    assert letter.sha256 and letter.size == len(_step(5, run_id="bad-run"))
    assert "bad-run" not in proc.monitors and "good-run" in proc.monitors  # only its own state went
    assert proc.counters.detector_errors == 1
    # the other run goes on and still finds its fault; the reset run starts again from its next event
    for s in range(5, 12):
        out = proc.process(_step(s, loss=math.nan if s >= 8 else 1.0, run_id="good-run"), key=b"good-run")
    assert [a.kind for a in out.actions] == [] and proc.counters.actions["stop"] == 1  # no checkpoint: a stop
    assert proc.process(_step(6, run_id="bad-run"), key=b"bad-run").errors == []
    assert "bad-run" in proc.monitors


def test_a_timer_error_resets_only_its_run(proc, monkeypatch):
    from runwatch.detectors.engine.monitor import RunMonitor

    for run in ("a", "b"):
        proc.process(_step(0, run_id=run), key=run.encode())
    original = RunMonitor.tick

    def tick(self, now):
        if self.run_id == "a":
            raise OverflowError("date value out of range")
        return original(self, now)

    monkeypatch.setattr(RunMonitor, "tick", tick)
    result = proc.tick(WALL + timedelta(seconds=1))
    assert [e.reason for e in result.errors] == ["detector_error: OverflowError: date value out of range"]
    assert set(proc.monitors) == {"b"}


def test_a_tick_stops_at_its_budget_and_the_next_one_goes_on_where_it_stopped(monkeypatch):
    from runwatch.detectors.engine.monitor import RunMonitor

    clock = {"t": 0.0}
    proc = TelemetryProcessor(RunwatchConfig(), SECRET, clock=lambda: WALL, perf_clock=lambda: clock["t"])
    for i in range(10):
        proc.process(_step(0, run_id=f"r{i}"), key=f"r{i}".encode())
    judged: list[str] = []
    original = RunMonitor.tick

    def slow_tick(self, now):
        judged.append(self.run_id)
        clock["t"] += 0.04  # each run takes 40 ms: the 100 ms budget covers three
        return original(self, now)

    monkeypatch.setattr(RunMonitor, "tick", slow_tick)
    proc.tick()
    assert judged == ["r0", "r1", "r2"] and proc.counters.tick_deferred == 1
    proc.tick()
    assert judged[3:] == ["r3", "r4", "r5"]  # round robin: nobody waits for more than a few ticks
    for _ in range(3):
        proc.tick()
    assert set(judged) == {f"r{i}" for i in range(10)}


def test_one_event_from_a_skewed_clock_does_not_move_the_run_clock_ahead(proc):
    """A step stamped 200 s ahead (within max_future_s) of its record's timestamp: the run's clock
    stays at the record's time, so the run's other ranks do not look silent at the next tick."""
    sent = T0.timestamp()
    proc.process(_step(0), key=b"run-1", timestamp=sent)
    ahead = StepEvent(run_id="run-1", step=1, ts=T0 + timedelta(seconds=200)).to_json()
    assert proc.process(ahead, key=b"run-1", timestamp=sent + 1).deadletter is None
    assert proc._last_seen["run-1"][0] <= T0 + timedelta(seconds=2)


def test_a_timestamp_far_from_the_record_time_is_dead_lettered(proc):
    sent = T0.timestamp()
    for ts, word in ((T0 + timedelta(days=30000), "after"), (T0 - timedelta(days=8), "before")):
        raw = StepEvent(run_id="run-1", step=1, ts=ts).to_json()
        letter = proc.process(raw, key=b"run-1", timestamp=sent).deadletter
        assert letter is not None and letter.reason.startswith("limits: ts:") and word in letter.reason
    assert "run-1" not in proc.monitors


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


# -- issue 23: a record time a client chose must not take the worker down -------------------------

_Y9999 = (
    b'{"schema_version":1,"event_id":"e1","run_id":"r","rank":0,"ts":"9999-12-31T23:59:59Z",'
    b'"kind":"step","step":1,"loss":2.0}'
)


@pytest.mark.parametrize(
    "record_ts", [None, 0.0, -1.0, 253402300800.0 * 10, float("nan"), float("inf"), 253402300799.0]
)  # missing, 0, -1, past year 9999, NaN, inf, 9999-12-31
def test_an_untrusted_record_time_makes_the_worker_clock_bound_ts(proc, record_ts):
    """The crash-loop record: ts 9999-12-31 with a record time 0 (or missing, or absurd) was accepted
    unchecked, and the next tick overflowed outside its guard, killing every successor."""
    result = proc.process(_Y9999, key=b"r", partition=0, offset=1, timestamp=record_ts)
    assert result.deadletter is not None and result.deadletter.reason.startswith("limits: ts:"), result
    assert "r" not in proc.monitors
    assert proc.tick(WALL + timedelta(seconds=5)).errors == []


def test_a_trusted_record_time_still_bounds_ts_as_before(proc):
    # a backlog read hours later: judged against when it was sent, not against now
    sent = T0 + timedelta(seconds=3)
    ok = proc.process(_step(3), key=b"run-1", timestamp=sent.timestamp())
    assert ok.deadletter is None
    late = StepEvent(run_id="run-1", step=4, loss=1.0, ts=T0 + timedelta(hours=2)).to_json()
    bad = proc.process(late, key=b"run-1", timestamp=sent.timestamp())
    assert bad.deadletter is not None and "after the receive time" in bad.deadletter.reason


def test_a_run_clock_that_overflows_in_the_tick_resets_only_that_run(proc):
    for run in ("a", "b"):
        proc.process(_step(0, run_id=run), key=run.encode())
    far = datetime.max.replace(tzinfo=UTC) - timedelta(seconds=1)
    proc._last_seen["a"] = (far, WALL)  # however it got there, a tick adding time to it overflows
    result = proc.tick(WALL + timedelta(seconds=10))
    assert [e.reason.split(":")[1].strip() for e in result.errors] == ["OverflowError"]
    assert result.errors[0].stage == "detector"
    assert set(proc.monitors) == {"b"}
    assert proc.tick(WALL + timedelta(seconds=11)).errors == []


@pytest.mark.parametrize(
    "run_id", ["a\nb", "a\x00b", "has space", "tab\there", "ü-run", "a<b>", "x" * 257, ""]
)
def test_a_run_id_outside_the_documented_characters_is_deadlettered(proc, run_id):
    raw = json.dumps(
        {
            "schema_version": 1,
            "event_id": "e",
            "run_id": run_id,
            "rank": 0,
            "ts": T0.isoformat(),
            "kind": "step",
            "step": 1,
        }
    ).encode()
    result = proc.process(raw, key=run_id.encode() or None)
    assert result.deadletter is not None, run_id
    assert "run_id" in result.deadletter.reason
    assert proc.monitors == {}


@pytest.mark.parametrize("run_id", ["run-42", "llama/7b:pretrain@node+1=ok", "a.b_c-d", "x" * 256])
def test_run_ids_of_the_documented_characters_are_accepted(proc, run_id):
    result = proc.process(_step(1, run_id=run_id), key=run_id.encode())
    assert result.deadletter is None and run_id in proc.monitors


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
    proc.process(_step(0, run_id="quiet"), key=b"quiet", partition=1)
    wall[0] = WALL + timedelta(seconds=300)
    proc.process(_step(1, run_id="talks"), key=b"talks", partition=2)
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
    assert proc.process(_step(2, run_id="quiet"), key=b"quiet", partition=1).deadletter is None
    assert "quiet" in proc.monitors


def test_past_max_runs_the_least_recently_active_run_is_let_go_with_a_finding():
    config = RunwatchConfig.model_validate({"runs": {"max_runs": 3}})
    proc = TelemetryProcessor(config, SECRET, clock=lambda: WALL)
    for run in ("r1", "r2", "r3"):
        proc.process(_step(0, run_id=run), key=run.encode())
    proc.process(_step(1, run_id="r1"), key=b"r1")  # r1 active again: r2 is now the least recent
    result = proc.process(_step(0, run_id="r4"), key=b"r4")
    (finding,) = result.anomalies
    assert (finding.run_id, finding.metric, finding.severity) == ("r2", "evicted", "info")
    assert "limit of 3 runs" in finding.message
    assert set(proc.monitors) == {"r1", "r3", "r4"} and proc.counters.runs_let_go["evicted"] == 1
