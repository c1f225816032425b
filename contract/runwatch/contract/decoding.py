"""Decoding: one telemetry record to a checked event (``decode_event``, ``decode_received``), the record's
key and receive time, and the worker's own messages back from JSON."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from pydantic import ValidationError

from runwatch.contract import groups, topics
from runwatch.contract.limit_checks import check_limits
from runwatch.contract.limits import DEFAULT_LIMITS, WireLimits
from runwatch.contract.messages.base import SCHEMA_VERSION, EventBase
from runwatch.contract.messages.crash import CrashEvent, bound_crash
from runwatch.contract.messages.evidence import StackEvidenceEvent, bound_evidence
from runwatch.contract.messages.run import GroupReport
from runwatch.contract.messages.telemetry import TelemetryEvent, telemetry_adapter
from runwatch.contract.messages.worker import MAX_CLOCK_AHEAD_S, Action, Anomaly
from runwatch.contract.public_name import known_as_schema


@known_as_schema
class SchemaError(ValueError):
    """A message that is not valid runwatch JSON; ``reason`` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


SUPPORTED_SCHEMA_VERSIONS = frozenset({SCHEMA_VERSION})
# Present in every telemetry event, whatever its kind: a missing one is refused, never defaulted
# (a defaulted event_id would defeat deduplication, a defaulted ts or rank would lie).
REQUIRED_FIELDS = ("schema_version", "event_id", "run_id", "rank", "ts", "kind")


def _loads(raw: bytes | str | None) -> Any:
    if raw is None:
        raise SchemaError("null value (a Kafka tombstone): a telemetry message must be a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<message>"
        parts.append(f"{loc}: {err['msg']}")
    return "schema: " + "; ".join(parts)


def record_time(timestamp_s: float | None) -> datetime | None:
    """A Kafka record's timestamp (seconds since the epoch) as the UTC ``received_at`` that
    ``decode_event`` bounds ``ts`` by; None when absent or unusable (then ``ts`` is not bounded)."""
    if timestamp_s is None or not timestamp_s > 0:
        return None
    try:
        return datetime.fromtimestamp(timestamp_s, UTC)
    except (OverflowError, OSError, ValueError):
        return None


def check_record_key(key: bytes | None, partition: int | None, partitions: int | None) -> None:
    """Raise ``SchemaError`` unless a telemetry record has a key and, where the topic's partition count
    is known, sits on its key's partition (murmur2, ``topics.key_partition``). The key is the run id and
    decides the partition, hence which worker owns the run: a record without one, or elsewhere, would
    split a run's state between workers. (That the key equals the event's run id ``decode_event`` checks.)"""
    if key is None:
        raise SchemaError("key: missing (the record's key must be the run id)")
    if partitions and partition is not None:
        expected = topics.key_partition(key, partitions)
        if partition != expected:
            raise SchemaError(
                f"partition: the record is on partition {partition}, its key's partition is "
                f"{expected} of {partitions} (murmur2 of the key, the Java and kafka-python "
                "default partitioner)"
            )


def clock_ahead(
    timestamp_s: float | None, now: datetime, limits: WireLimits = DEFAULT_LIMITS
) -> float | None:
    """Seconds a sender's clock is ahead of ``now`` (the reader's), by a record time more than
    ``limits.max_future_s`` and at most ``MAX_CLOCK_AHEAD_S`` ahead of it; None otherwise. Such a record and
    its event's ``ts`` agree on a fast clock (issue 35): the worker judges the event against the record time
    and moves its time back by this much, rather than refusing every event of a trainer whose clock is
    minutes fast."""
    received = record_time(timestamp_s)
    if received is None:
        return None
    ahead = (received - now).total_seconds()
    return ahead if limits.max_future_s < ahead <= MAX_CLOCK_AHEAD_S else None


def receive_time(timestamp_s: float | None, now: datetime, limits: WireLimits = DEFAULT_LIMITS) -> datetime:
    """The ``received_at`` a consumer (the worker, the sink) checks an event's ``ts`` against: the
    Kafka record's timestamp, unless it is missing, unusable or more than ``limits.max_future_s``
    ahead of ``now`` (the reader's clock), in which case ``now``. A client sets the record time (0,
    -1, year 9999): one in the future is no send time. A past one is trusted, so that a backlog or a
    recording replayed with its timestamps keeps its verdicts."""
    received = record_time(timestamp_s)
    if received is None or (received - now).total_seconds() > limits.max_future_s:
        return now
    return received


def decode_event(
    raw: bytes | str | None,
    *,
    received_at: datetime | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
    key: bytes | None = None,
) -> TelemetryEvent:
    """Parse and check one telemetry message; raises ``SchemaError`` with a one-line reason.

    Strict: every field of ``REQUIRED_FIELDS`` present, no coercion between types (a step must be
    a JSON integer, a loss a number or one of "NaN"/"Infinity"/"-Infinity", ``ts`` an ISO 8601
    string with a timezone), a supported ``schema_version``, and the bounds of ``limits``.
    ``received_at`` (the record's timestamp) bounds ``ts``; None skips that check (offline replay).
    ``key``: the Kafka key, which must be the run id (it decides the partition, hence which worker
    owns the run); None skips that check.
    """
    if raw is not None and len(raw) > limits.max_message_bytes:
        raise SchemaError(f"message of {len(raw)} bytes (limit {limits.max_message_bytes})")
    data = _loads(raw)
    if not isinstance(data, dict):
        raise SchemaError(f"schema: expected a JSON object, got {type(data).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in data]
    if missing:
        raise SchemaError(f"schema: missing required field(s) {', '.join(missing)}")
    version = data["schema_version"]
    if type(version) is not int or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaError(
            f"schema_version: {version!r} is not supported (supported: {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    try:
        event = telemetry_adapter.validate_python(data, strict=True)
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None
    if isinstance(event, StackEvidenceEvent):
        event = bound_evidence(event, limits)  # (over its bounds: truncated with a mark, never refused)
    elif isinstance(event, CrashEvent):
        event = bound_crash(event)  # (the same: a crash report is cut, never refused for its size alone)
    problem = check_limits(event, data, received_at, limits)
    if problem:
        raise SchemaError(f"limits: {problem}")
    if key is not None:
        problem = key_problem(key, event)
        if problem:
            raise SchemaError(problem)
    return event


def key_problem(key: bytes, event: EventBase) -> str | None:
    """Why ``key`` is not the Kafka key of ``event`` (``groups.record_key``), or None. In a split run (the
    event says ``group_size``) a rank's key names its group: a rank that claims another group, or an event
    that says a group size without the world size or a rank outside the world, is refused."""
    group_size = event.group_size
    if group_size is None or isinstance(event, GroupReport):
        if key != event.run_id.encode():
            return f"key {key[:100]!r} does not match run_id {event.run_id[:100]!r}"
        return None
    rank, world_size = event.rank, event.world_size
    if world_size is None:
        return "group_size: given without world_size (a split run's events carry both)"
    if rank >= world_size:
        return f"rank: {rank} is outside the run's world of {world_size} ranks"
    expected = groups.record_key(event.run_id, rank, group_size)
    if key == expected:
        return None
    run_id, group = groups.parse_key(key.decode(errors="replace"))
    if run_id == event.run_id and group is not None:
        return (
            f"group: rank {rank} claims group {group}; with group_size {group_size} it is in group "
            f"{groups.group_of(rank, group_size)}"
        )
    return (
        f"key {key[:100]!r} does not match run_id {event.run_id[:100]!r} and its rank's group "
        f"({expected.decode()!r})"
    )


def decode_received(
    raw: bytes | str | None,
    timestamp_s: float | None,
    now: datetime,
    limits: WireLimits = DEFAULT_LIMITS,
    key: bytes | None = None,
) -> tuple[TelemetryEvent, datetime, float | None]:
    """A telemetry record as the worker and the sink judge it: ``decode_event`` against the record's
    receive time (``receive_time``). Returns the event, that receive time on the reader's clock, and the
    seconds the sender's clock is ahead when its record time is beyond the allowance (``clock_ahead``; else
    None): such an event is judged against its record time, and its ``ts`` moved back onto the reader's
    clock by that much."""
    # receive_time and clock_ahead, from one reading of the record time
    record = record_time(timestamp_s)
    received, ahead = now, None
    if record is not None:
        record_ahead = (record - now).total_seconds()
        if record_ahead <= limits.max_future_s:
            received = record
        elif record_ahead <= MAX_CLOCK_AHEAD_S:
            ahead = record_ahead
    judged_at = record if ahead is not None else received
    event = decode_event(raw, received_at=judged_at, limits=limits, key=key)
    if ahead is not None:
        event = event.model_copy(update={"ts": event.ts - timedelta(seconds=ahead)})
    return event, received, ahead


def decode_anomaly(raw: bytes | str) -> Anomaly:
    try:
        return Anomaly.model_validate(_loads(raw))
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None


def decode_action(raw: bytes | str) -> Action:
    try:
        return Action.model_validate(_loads(raw))
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None
