"""The processor's timer, without Faust or a broker: every held run gets its time-based checks, each
judged on its own event time carried forward by the wall clock (not while its partition lags), within a
budget per tick; and one run's failure, in its detectors or its timer, resets that run alone."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.processor_events import SECRET, WALL, step_json

# -- the timer -------------------------------------------------------------------------------------


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
    proc.process(step_json(0, run_id="stays"), key=b"stays", partition=1)
    proc.process(step_json(0, run_id="moves"), key=b"moves", partition=3)
    assert proc.keep_partitions({0, 1}) == ["moves"]
    assert set(proc.monitors) == {"stays"}
    assert proc.tick().anomalies == []  # the timer no longer judges the run it gave away


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
        assert proc.process(step_json(s, run_id="bad-run"), key=b"bad-run").errors == []
        proc.process(step_json(s, run_id="good-run"), key=b"good-run")
    result = proc.process(step_json(5, run_id="bad-run"), key=b"bad-run", partition=3, offset=77)
    [letter] = result.errors
    assert letter.stage == "detector" and letter.reason.startswith("detector_error: ZeroDivisionError")
    assert "a detector divided by zero" in letter.traceback and (letter.partition, letter.offset) == (3, 77)
    assert letter.sha256 and letter.size == len(step_json(5, run_id="bad-run"))
    assert "bad-run" not in proc.monitors and "good-run" in proc.monitors  # only its own state went
    assert proc.counters.detector_errors == 1
    # the other run goes on and still finds its fault; the reset run starts again from its next event
    for s in range(5, 12):
        out = proc.process(step_json(s, loss=math.nan if s >= 8 else 1.0, run_id="good-run"), key=b"good-run")
    assert [a.kind for a in out.actions] == [] and proc.counters.actions["stop"] == 1  # no checkpoint: a stop
    assert proc.process(step_json(6, run_id="bad-run"), key=b"bad-run").errors == []
    assert "bad-run" in proc.monitors


def test_a_timer_error_resets_only_its_run(proc, monkeypatch):
    from runwatch.detectors.engine.monitor import RunMonitor

    for run in ("a", "b"):
        proc.process(step_json(0, run_id=run), key=run.encode())
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
        proc.process(step_json(0, run_id=f"r{i}"), key=f"r{i}".encode())
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


def test_a_run_clock_that_overflows_in_the_tick_resets_only_that_run(proc):
    for run in ("a", "b"):
        proc.process(step_json(0, run_id=run), key=run.encode())
    far = datetime.max.replace(tzinfo=UTC) - timedelta(seconds=1)
    proc._last_seen["a"] = (far, WALL)  # however it got there, a tick adding time to it overflows
    result = proc.tick(WALL + timedelta(seconds=10))
    assert [e.reason.split(":")[1].strip() for e in result.errors] == ["OverflowError"]
    assert result.errors[0].stage == "detector"
    assert set(proc.monitors) == {"b"}
    assert proc.tick(WALL + timedelta(seconds=11)).errors == []
