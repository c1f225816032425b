"""Event and record times the processor cannot trust (issue 23), without Faust or a broker: an event
stamped far from its record's time is dead-lettered, one from a skewed clock does not move its run's
clock ahead, and a record time a client chose (0, missing, NaN, past the year 9999) cannot take the
worker down."""

from __future__ import annotations

from datetime import timedelta

import pytest

from runwatch.contract.schema import StepEvent
from tests.support.processor_events import T0, WALL, step_json

# -- event times against the record's time ---------------------------------------------------------


def test_one_event_from_a_skewed_clock_does_not_move_the_run_clock_ahead(proc):
    """A step stamped 200 s ahead (within max_future_s) of its record's timestamp: the run's clock
    stays at the record's time, so the run's other ranks do not look silent at the next tick."""
    sent = T0.timestamp()
    proc.process(step_json(0), key=b"run-1", timestamp=sent)
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
    ok = proc.process(step_json(3), key=b"run-1", timestamp=sent.timestamp())
    assert ok.deadletter is None
    late = StepEvent(run_id="run-1", step=4, loss=1.0, ts=T0 + timedelta(hours=2)).to_json()
    bad = proc.process(late, key=b"run-1", timestamp=sent.timestamp())
    assert bad.deadletter is not None and "after the receive time" in bad.deadletter.reason
