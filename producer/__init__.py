"""What training code imports: the wire schema, the publisher (and its offline twin, the JSONL
recorder), torch instrumentation and the action listener.

Never imports Faust, river or ClickHouse; torch only lazily, where it is used.
"""

from runwatch.producer.actions import ActionListener, AppliedAction, save_checkpoint
from runwatch.producer.categories import CategoryLossBatch, category_loss
from runwatch.producer.heartbeat import Heartbeat
from runwatch.producer.publisher import PublisherStats, RunWatch
from runwatch.producer.recorder import JsonlRecorder
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
from runwatch.producer.watch import Watcher

__all__ = [
    "Action",
    "ActionAckEvent",
    "ActionListener",
    "Anomaly",
    "AppliedAction",
    "CategoryLossBatch",
    "CheckpointEvent",
    "CheckpointRef",
    "EvalEvent",
    "Heartbeat",
    "HeartbeatEvent",
    "JsonlRecorder",
    "PublisherStats",
    "RunEndEvent",
    "RunStartEvent",
    "RunWatch",
    "SchemaError",
    "StepEvent",
    "Watcher",
    "category_loss",
    "decode_event",
    "save_checkpoint",
]
