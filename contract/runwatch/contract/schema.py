"""The wire contract: every message on every runwatch topic, defined once.

Messages are JSON (orjson) objects. Telemetry events are discriminated by ``kind``.
Non-finite floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
because JSON has no literal for them and a NaN loss is exactly what we must not lose.
Unknown fields from a newer producer are kept (``extra="allow"``); a missing required
field is a validation error, which the worker routes to the dead-letter topic.

One name for the whole contract: the messages live in ``runwatch.contract.messages`` (one module per
family), the limits in ``limits`` (with ``Within``, the range a field declares on itself), their checks in
``limit_checks`` and the decoding in ``decoding``; this module hands every name on.
"""

from __future__ import annotations

from runwatch.contract.decoding import (
    REQUIRED_FIELDS,
    SUPPORTED_SCHEMA_VERSIONS,
    SchemaError,
    check_record_key,
    clock_ahead,
    decode_action,
    decode_anomaly,
    decode_event,
    decode_received,
    key_problem,
    receive_time,
    record_time,
)
from runwatch.contract.limits import (
    DEFAULT_LIMITS,
    WireLimits,
    Within,
)
from runwatch.contract.messages.base import (
    ELLIPSIS,
    RUN_ID_MAX_CHARS,
    SCHEMA_VERSION,
    SEVERITY_RANK,
    EventBase,
    Phase,
    Severity,
    WireFloat,
    WireModel,
    WireTime,
    new_id,
    run_id_problem,
    utc_now,
)
from runwatch.contract.messages.crash import (
    CRASH_MESSAGE_CHARS,
    CRASH_NAME_CHARS,
    CRASH_TEXT_CHARS,
    CrashEvent,
    CrashSource,
    bound_crash,
    clip_keep_end,
    clip_keep_head,
)
from runwatch.contract.messages.dead_letter import (
    DEADLETTER_RAW_MAX_BYTES,
    DeadLetter,
)
from runwatch.contract.messages.evidence import (
    EVIDENCE_STATUS_CHARS,
    EVIDENCE_STRING_CHARS,
    EvidenceReason,
    StackEvidenceEvent,
    StackFrame,
    StackSource,
    ThreadStack,
    bound_evidence,
    clip_flight_recorder,
)
from runwatch.contract.messages.heartbeat import (
    GPU_REASON_CHARS,
    GPU_REASONS_MAX,
    GpuHealth,
    HeartbeatEvent,
    HostLoad,
)
from runwatch.contract.messages.run import (
    ActionAckEvent,
    CheckpointEvent,
    EvalEvent,
    GroupReport,
    RunEndEvent,
    RunStartEvent,
)
from runwatch.contract.messages.step import (
    DIGEST_GROUPS,
    DIGEST_RANKS_LISTED,
    ActivationStats,
    CategoryLoss,
    DigestGroup,
    Instrumentation,
    MemoryStats,
    RankExtreme,
    ReplicaDigests,
    StepEvent,
    UpdateSkipped,
)
from runwatch.contract.messages.telemetry import (
    EVENT_KINDS,
    EVENT_MODELS,
    ProducerEvent,
    TelemetryEvent,
)
from runwatch.contract.messages.worker import (
    CLOCK_AHEAD_PARAM,
    MAX_CLOCK_AHEAD_S,
    RANKS_LISTED,
    Action,
    Anomaly,
    CheckpointRef,
    JoinedStep,
    action_expiry,
    newest_checkpoint_before,
)

__all__ = [
    "Action",
    "ActionAckEvent",
    "ActivationStats",
    "Anomaly",
    "CLOCK_AHEAD_PARAM",
    "CRASH_MESSAGE_CHARS",
    "CRASH_NAME_CHARS",
    "CRASH_TEXT_CHARS",
    "CategoryLoss",
    "CheckpointEvent",
    "CheckpointRef",
    "CrashEvent",
    "CrashSource",
    "DEADLETTER_RAW_MAX_BYTES",
    "DEFAULT_LIMITS",
    "DIGEST_GROUPS",
    "DIGEST_RANKS_LISTED",
    "DeadLetter",
    "DigestGroup",
    "ELLIPSIS",
    "EVENT_KINDS",
    "EVENT_MODELS",
    "EVIDENCE_STATUS_CHARS",
    "EVIDENCE_STRING_CHARS",
    "EvalEvent",
    "EventBase",
    "EvidenceReason",
    "GPU_REASONS_MAX",
    "GPU_REASON_CHARS",
    "GpuHealth",
    "GroupReport",
    "HeartbeatEvent",
    "HostLoad",
    "Instrumentation",
    "JoinedStep",
    "MAX_CLOCK_AHEAD_S",
    "MemoryStats",
    "Phase",
    "ProducerEvent",
    "RANKS_LISTED",
    "REQUIRED_FIELDS",
    "RUN_ID_MAX_CHARS",
    "RankExtreme",
    "ReplicaDigests",
    "RunEndEvent",
    "RunStartEvent",
    "SCHEMA_VERSION",
    "SEVERITY_RANK",
    "SUPPORTED_SCHEMA_VERSIONS",
    "SchemaError",
    "Severity",
    "StackEvidenceEvent",
    "StackFrame",
    "StackSource",
    "StepEvent",
    "TelemetryEvent",
    "ThreadStack",
    "UpdateSkipped",
    "WireFloat",
    "WireLimits",
    "WireModel",
    "WireTime",
    "Within",
    "action_expiry",
    "bound_crash",
    "bound_evidence",
    "check_record_key",
    "clip_flight_recorder",
    "clip_keep_end",
    "clip_keep_head",
    "clock_ahead",
    "decode_action",
    "decode_anomaly",
    "decode_event",
    "decode_received",
    "key_problem",
    "new_id",
    "newest_checkpoint_before",
    "receive_time",
    "record_time",
    "run_id_problem",
    "utc_now",
]
