"""Every telemetry event, one model per ``kind``: the union the worker decodes."""

from __future__ import annotations

from typing import Annotated, get_args

from pydantic import Field, TypeAdapter

from runwatch.contract.messages.base import EventBase
from runwatch.contract.messages.crash import CrashEvent
from runwatch.contract.messages.evidence import StackEvidenceEvent
from runwatch.contract.messages.heartbeat import HeartbeatEvent
from runwatch.contract.messages.run import (
    ActionAckEvent,
    CheckpointEvent,
    EvalEvent,
    GroupReport,
    RunEndEvent,
    RunStartEvent,
)
from runwatch.contract.messages.step import StepEvent

# What a trainer (any producer, in any language) sends: one model per kind, told apart by ``kind``.
ProducerEvent = (
    RunStartEvent
    | StepEvent
    | EvalEvent
    | HeartbeatEvent
    | CheckpointEvent
    | ActionAckEvent
    | RunEndEvent
    | StackEvidenceEvent
    | CrashEvent
)
# Everything on the telemetry topic: the producers' events, and the workers' reports of a split run's groups.
TelemetryEvent = Annotated[ProducerEvent | GroupReport, Field(discriminator="kind")]
EVENT_MODELS: tuple[type[EventBase], ...] = get_args(ProducerEvent)
# The kinds a producer sends, in the union's order (each model's ``kind`` default): the documented kinds.
EVENT_KINDS: tuple[str, ...] = tuple(model.model_fields["kind"].default for model in EVENT_MODELS)
telemetry_adapter: TypeAdapter[TelemetryEvent] = TypeAdapter(TelemetryEvent)
