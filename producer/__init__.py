"""What training code imports: the wire schema, the publisher and the action listener.

Never imports Faust, river or ClickHouse; torch only lazily, where it is used.
"""

from runwatch.producer.actions import ActionListener, AppliedAction, save_checkpoint
from runwatch.producer.publisher import PublisherStats, RunWatch
from runwatch.producer.schema import (
    Action,
    ActionAckEvent,
    Anomaly,
    CheckpointEvent,
    CheckpointRef,
    EvalEvent,
    HeartbeatEvent,
    RunEndEvent,
    RunStartEvent,
    SchemaError,
    StepEvent,
    decode_event,
)

__all__ = [
    "Action",
    "ActionAckEvent",
    "ActionListener",
    "Anomaly",
    "AppliedAction",
    "CheckpointEvent",
    "CheckpointRef",
    "EvalEvent",
    "HeartbeatEvent",
    "PublisherStats",
    "RunEndEvent",
    "RunStartEvent",
    "RunWatch",
    "SchemaError",
    "StepEvent",
    "decode_event",
    "save_checkpoint",
]
