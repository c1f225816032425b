"""Property-based fuzz of the worker's per-message logic (issue 23): whatever a client puts in an
event's fields or in the record's metadata (timestamp, key, partition), the processor never raises,
every message is either handled or dead-lettered with a reason, and neither an event nor the timer's
tick makes a detector fail (no ``detector_error``). Driven in-process; the worker reads no record
headers, so there are none to vary. tests/worker/test_fuzz_pipeline.py does the same over the
real broker, worker and sink."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runwatch.contract import topics
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import SEED

WALL = datetime(2026, 11, 27, 12, tzinfo=UTC)
PARTITIONS = 4
RUNS = ["fz-a", "fz-b", "fz/c:1", "a\nb", "x" * 300]

# A valid event of each kind, the fields a kind needs beside the common ones
_KIND_FIELDS = {
    "run_start": {"world_size": 2, "attempt": "a1"},
    "step": {"step": 1, "loss": 1.0, "grad_norm": 1.0, "step_time_s": 0.1, "memory": {"allocated": 10**9}},
    "eval": {"step": 1, "loss": 1.0},
    "heartbeat": {"step": 1, "phase": "train", "time_in_phase_s": 1.0, "interval_s": 0.5},
    "checkpoint": {"step": 1, "uri": "/c/1.pt"},
    "action_ack": {"action_id": "a1", "outcome": "applied"},
    "run_end": {"status": "completed"},
}
_extreme_times = st.one_of(
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)).map(
        lambda t: t.isoformat()
    ),
    st.sampled_from(
        [
            "9999-12-31T23:59:59Z",
            "0001-01-01T00:00:00Z",
            "2026-11-27T12:00:00",
            "soon",
            "",
            (WALL + timedelta(seconds=299)).isoformat(),
            (WALL - timedelta(days=6, hours=23)).isoformat(),
        ]
    ),
)
_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
_ints = st.one_of(st.integers(min_value=-5, max_value=50), st.integers(min_value=-(2**70), max_value=2**70))
# the record's timestamp in seconds: missing, 0, negative, NaN, infinite, past 9999, any other
_record_times = st.one_of(
    st.none(),
    st.sampled_from([0.0, -1.0, math.nan, math.inf, 253402300799.0, 1e15]),
    st.floats(min_value=WALL.timestamp() - 86400 * 30, max_value=WALL.timestamp() + 86400 * 30),
)

# What a careless or hostile client changes in a valid message: (field, values); "key", "partition" and
# "record_ts" are the record's metadata; None as a value drops the field.
_MUTATIONS = st.one_of(
    st.tuples(st.just("ts"), _extreme_times),
    st.tuples(st.just("record_ts"), _record_times),
    st.tuples(st.just("ts+record_ts"), st.tuples(_extreme_times, _record_times)),  # both: a client sets both
    st.tuples(st.just("key"), st.sampled_from([None, b"other-run", b"\xff\xfe"])),
    st.tuples(st.just("partition"), st.integers(min_value=0, max_value=3)),
    st.tuples(
        st.sampled_from(["loss", "grad_norm", "step_time_s", "interval_s", "time_in_phase_s"]), _floats
    ),
    st.tuples(st.sampled_from(["step", "rank", "world_size"]), _ints),
    st.tuples(st.just("run_id"), st.sampled_from(["a\nb", "x" * 300, "", "ü"])),
    st.tuples(st.sampled_from(["event_id", "ts", "kind", "rank", "step", "uri"]), st.none()),
    st.tuples(st.just("memory"), st.fixed_dictionaries({}, optional={"allocated": _ints, "host_rss": _ints})),
    st.tuples(
        st.just("module_grad_norms"), st.dictionaries(st.sampled_from(["enc", "head\n"]), _floats, max_size=2)
    ),
    st.tuples(
        st.just("extra"),
        st.recursive(st.none() | st.integers(), lambda c: st.lists(c, max_size=2), max_leaves=60),
    ),
)

_messages = st.tuples(
    st.sampled_from(sorted(_KIND_FIELDS)),
    st.sampled_from(["fz-a", "fz-b", "fz/c:1"]),
    st.integers(min_value=0, max_value=3600),  # seconds before WALL the event was sent
    st.lists(_MUTATIONS, max_size=2),
    st.booleans(),  # a tick after it
)


def _record(
    i: int, kind: str, run_id: str, ago: int, mutations: list
) -> tuple[bytes, bytes | None, int, float | None]:
    """(value, key, partition, record time) of a valid message of ``kind``, then ``mutations`` applied."""
    sent = WALL - timedelta(seconds=ago)
    body: dict = {
        "schema_version": 1,
        "event_id": f"e{i}",
        "run_id": run_id,
        "rank": 0,
        "ts": sent.isoformat(),
        "kind": kind,
        **_KIND_FIELDS[kind],
    }
    meta: dict = {"key": run_id.encode(), "partition": None, "record_ts": sent.timestamp()}
    for name, value in mutations:
        if name == "ts+record_ts":
            body["ts"], meta["record_ts"] = value
            continue
        target = meta if name in meta else body
        if value is None and target is body:
            body.pop(name, None)
        else:
            target[name] = value
    key = meta["key"]
    partition = meta["partition"]
    if partition is None:
        partition = topics.key_partition(key, PARTITIONS) if key else 0
    return json.dumps(body, allow_nan=True).encode(), key, partition, meta["record_ts"]


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_messages, min_size=1, max_size=60))
def test_no_message_or_record_metadata_makes_the_processor_raise_or_a_detector_fail(messages):
    proc = TelemetryProcessor(RunwatchConfig(), SEED, clock=lambda: WALL, partitions=PARTITIONS)
    handled = 0
    for i, (kind, run_id, ago, mutations, tick) in enumerate(messages):
        value, key, partition, record_ts = _record(i, kind, run_id, ago, mutations)
        result = proc.process(value, key=key, partition=partition, offset=i, timestamp=record_ts)
        if result.deadletter is not None:
            assert result.deadletter.reason and mutations, (
                value,
                result.deadletter.reason,
            )  # never a valid one
        else:
            handled += 1
        if tick:
            out = proc.tick(WALL + timedelta(seconds=i))
            assert out.errors == [], [e.reason for e in out.errors]
    assert proc.tick(WALL + timedelta(hours=3)).errors == []
    assert proc.counters.detector_errors == 0
    assert proc.counters.processed + proc.counters.deadlettered == len(messages)
    assert proc.counters.processed == handled
