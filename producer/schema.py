"""The wire contract: every message on every runwatch topic, defined once.

Messages are JSON (orjson) objects. Telemetry events are discriminated by ``kind``.
Non-finite floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
because JSON has no literal for them and a NaN loss is exactly what we must not lose.
Unknown fields from a newer producer are kept (``extra="allow"``); a missing required
field is a validation error, which the worker routes to the dead-letter topic.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

SCHEMA_VERSION = 1

Phase = Literal["train", "eval", "checkpoint", "dataload", "idle"]
Severity = Literal["info", "warning", "critical"]
ActionKind = Literal["alert", "pause", "resume", "rollback", "stop"]

SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class WireModel(BaseModel):
    """Base of every wire message: keeps unknown fields, writes NaN/Inf as strings."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings", populate_by_name=True)

    def to_json(self) -> bytes:
        # pydantic's serializer, not orjson: orjson writes NaN as null, which would erase
        # the very non-finite loss a detector must see. Decoding uses orjson.
        return self.model_dump_json(exclude_none=True).encode()


class EventBase(WireModel):
    schema_version: int = SCHEMA_VERSION
    event_id: str = Field(default_factory=new_id, min_length=1)
    run_id: str = Field(min_length=1)
    rank: int = Field(default=0, ge=0)
    ts: datetime = Field(default_factory=utc_now)


class RunStartEvent(EventBase):
    kind: Literal["run_start"] = "run_start"
    job_id: str | None = None
    baseline_key: str | None = None
    git_sha: str | None = None
    git_dirty: bool | None = None
    host: str | None = None
    world_size: int = Field(default=1, ge=1)
    torch_version: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    gpu_names: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    config_hash: str | None = None
    seed: int | None = None
    dataset_version: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)


class CategoryLoss(WireModel):
    mean: float
    count: int = Field(ge=0)


class MemoryStats(WireModel):
    """Bytes. A source that is not available is absent, never zero."""

    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    host_rss: int | None = None
    cgroup_usage: int | None = None
    cgroup_limit: int | None = None
    device_total: int | None = None  # CUDA device capacity: the limit allocated/reserved grow towards


class StepEvent(EventBase):
    kind: Literal["step"] = "step"
    step: int = Field(ge=0)
    loss: float | None = None
    lr: list[float] = Field(default_factory=list)
    grad_norm: float | None = None
    grad_norm_clipped: float | None = None
    clip_ratio: float | None = None
    param_norm: float | None = None
    update_norm: float | None = None
    relative_update_norm: float | None = None
    effective_lr_ratio: float | None = None
    module_grad_norms: dict[str, float] = Field(default_factory=dict)
    category_loss: dict[str, CategoryLoss] = Field(default_factory=dict)
    step_time_s: float | None = None
    data_wait_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    memory: MemoryStats | None = None
    nonfinite_grads: int | None = Field(default=None, ge=0)
    # True: grad_norm, grad_norm_clipped, module_grad_norms, param_norm and update_norm cover only
    # this rank's shard of the parameters (FSDP/ZeRO style); the worker's cross-rank join takes the
    # root of the sum of squares. Absent/False: every rank holds the full (replicated) figures.
    grad_sharded: bool | None = None
    # Seconds of this rank's own work in the step (from the step's start until it was ready to
    # synchronise gradients with its peers), without the time spent waiting for slower peers.
    # What straggler detection compares; absent where it is not measured.
    compute_s: float | None = Field(default=None, ge=0)


class EvalEvent(EventBase):
    kind: Literal["eval"] = "eval"
    step: int = Field(ge=0)
    split: str = "val"
    loss: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    per_category: dict[str, dict[str, float]] = Field(default_factory=dict)


class HeartbeatEvent(EventBase):
    kind: Literal["heartbeat"] = "heartbeat"
    step: int | None = None
    phase: Phase = "train"
    time_in_phase_s: float = Field(default=0.0, ge=0)
    # True: this rank has done its part of the current step and waits for its peers (its gradient
    # synchronisation is launched); False: it is still working on it; absent: not measured.
    in_sync: bool | None = None
    # The producer's heartbeat period: the worker calls a rank silent (dead) after a number of
    # missed periods rather than one fixed time; absent: only the configured floor applies.
    interval_s: float | None = Field(default=None, gt=0)


class CheckpointEvent(EventBase):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int = Field(ge=0)
    uri: str = Field(min_length=1)
    ok: bool = True


class ActionAckEvent(EventBase):
    kind: Literal["action_ack"] = "action_ack"
    action_id: str = Field(min_length=1)
    action_kind: ActionKind | None = None
    outcome: Literal["applied", "ignored", "failed"]
    detail: str | None = None
    step: int | None = None
    to_step: int | None = None


class RunEndEvent(EventBase):
    kind: Literal["run_end"] = "run_end"
    status: Literal["completed", "failed", "stopped", "interrupted"] = "completed"
    summary: dict[str, float | int | str | None] = Field(default_factory=dict)


TelemetryEvent = Annotated[
    RunStartEvent | StepEvent | EvalEvent | HeartbeatEvent | CheckpointEvent | ActionAckEvent | RunEndEvent,
    Field(discriminator="kind"),
]
EVENT_KINDS: tuple[str, ...] = (
    "run_start", "step", "eval", "heartbeat", "checkpoint", "action_ack", "run_end",
)
_telemetry_adapter: TypeAdapter[TelemetryEvent] = TypeAdapter(TelemetryEvent)


class Anomaly(WireModel):
    """A detector finding, as published on ``runwatch.anomalies``."""

    schema_version: int = SCHEMA_VERSION
    anomaly_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    step: int | None = None
    rank: int | None = None
    detector: str
    metric: str
    value: float | None = None
    threshold: float | None = None
    score: float | None = None
    severity: Severity
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    ts: datetime


class JoinedStep(WireModel):
    """One step of a run across its ranks, as the worker's join combined it (``runwatch.joined``).

    Gradient norms: the root of the sum of squares of the ranks' figures when they report shards
    (``grad_sharded``), else the largest (replicas agree). Loss: the mean over the ranks. Step time
    and memory: the extremes and the rank that has them. Throughput: the sum. ``complete`` is
    False when the join timed out without every rank (``ranks_missing``).
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str = Field(min_length=1)
    step: int = Field(ge=0)
    generation: int = Field(default=0, ge=0, description="rollbacks seen before this step (steps repeat after one)")
    ts: datetime
    world_size: int = Field(ge=1)
    complete: bool
    ranks_reported: list[int]
    ranks_missing: list[int] = Field(default_factory=list)
    loss_mean: float | None = None
    grad_norm: float | None = None
    grad_sharded: bool = False
    step_time_max_s: float | None = None
    step_time_max_rank: int | None = None
    step_time_min_s: float | None = None
    compute_max_s: float | None = None
    compute_max_rank: int | None = None
    compute_min_s: float | None = None
    memory_max_bytes: int | None = None
    memory_max_rank: int | None = None
    memory_min_bytes: int | None = None
    memory_min_rank: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    late_events: int = Field(default=0, ge=0, description="events of this run that came after their step was joined")
    duplicate_events: int = Field(default=0, ge=0, description="events of this run delivered more than once")


class CheckpointRef(WireModel):
    step: int = Field(ge=0)
    uri: str


def newest_checkpoint_before(checkpoints: list[CheckpointRef], onset_step: int | None) -> CheckpointRef | None:
    """The rollback target both sides agree on: the newest checkpoint strictly before the onset
    (a checkpoint taken at the faulty step may already hold its damage)."""
    earlier = [c for c in checkpoints if onset_step is None or c.step < onset_step]
    return max(earlier, key=lambda c: c.step) if earlier else None


class Action(WireModel):
    """A signed instruction to the trainer and remediators, on ``runwatch.actions``."""

    schema_version: int = SCHEMA_VERSION
    action_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    kind: ActionKind
    reason: str
    anomaly_ids: list[str] = Field(default_factory=list)
    step: int | None = None
    onset_step: int | None = None
    target_checkpoint: CheckpointRef | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    issued_at: datetime
    expires_at: datetime
    signature: str = ""

    def body_bytes(self) -> bytes:
        """Canonical bytes the signature covers: the message as sent (no null fields, NaN/Inf
        as strings) without ``signature``, keys sorted at every level, no whitespace."""
        sent = orjson.loads(self.model_dump_json(exclude={"signature"}, exclude_none=True))
        return orjson.dumps(sent, option=orjson.OPT_SORT_KEYS)

    def is_expired(self, now: datetime) -> bool:
        return now >= self.expires_at


class DeadLetter(WireModel):
    """Why a message could not be processed, with the original bytes (as text where possible)."""

    reason: str
    source_topic: str
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    raw: str
    ts: datetime = Field(default_factory=utc_now)


class SchemaError(ValueError):
    """A message that is not valid runwatch JSON; ``reason`` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _loads(raw: bytes | str) -> Any:
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


def decode_event(raw: bytes | str) -> TelemetryEvent:
    """Parse one telemetry message; raises ``SchemaError`` with a one-line reason."""
    data = _loads(raw)
    if not isinstance(data, dict):
        raise SchemaError(f"schema: expected a JSON object, got {type(data).__name__}")
    try:
        return _telemetry_adapter.validate_python(data)
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None


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


def action_expiry(issued_at: datetime, ttl_s: float) -> datetime:
    return issued_at + timedelta(seconds=ttl_s)
