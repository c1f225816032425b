"""What training code imports: the wire schema, the publisher (and its offline twin, the JSONL
recorder), torch instrumentation and the action listener.

Never imports Faust, river or ClickHouse; torch only lazily, where it is used. The names below
load their modules on first use, so the wire contract (``runwatch.producer.wire``) imports alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Lazy (PEP 562): importing ``runwatch.producer.wire`` (or any submodule) runs this file, and the
# wire contract must not load the publisher, the watcher, the action listener or torch.
_EXPORTS = {
    "ActionListener": "actions.listener",
    "AppliedAction": "actions.apply",
    "save_checkpoint": "actions.checkpoints",
    "CategoryLossBatch": "instrument.categories",
    "category_loss": "instrument.categories",
    "Heartbeat": "instrument.heartbeat",
    "PublisherStats": "publish.delivery",
    "MemoryDelivery": "publish.delivery",
    "RunWatch": "publish.run_watch",
    "JsonlRecorder": "publish.recorder",
    "Action": "wire.schema",
    "ActionAckEvent": "wire.schema",
    "Anomaly": "wire.schema",
    "CheckpointEvent": "wire.schema",
    "CheckpointRef": "wire.schema",
    "EvalEvent": "wire.schema",
    "HeartbeatEvent": "wire.schema",
    "RunEndEvent": "wire.schema",
    "RunStartEvent": "wire.schema",
    "SchemaError": "wire.schema",
    "StepEvent": "wire.schema",
    "decode_event": "wire.schema",
    "Watcher": "instrument.watch",
}

if TYPE_CHECKING:
    from runwatch.producer.actions.apply import AppliedAction
    from runwatch.producer.actions.checkpoints import save_checkpoint
    from runwatch.producer.actions.listener import ActionListener
    from runwatch.producer.instrument.categories import CategoryLossBatch, category_loss
    from runwatch.producer.instrument.heartbeat import Heartbeat
    from runwatch.producer.instrument.watch import Watcher
    from runwatch.producer.publish.delivery import MemoryDelivery, PublisherStats
    from runwatch.producer.publish.recorder import JsonlRecorder
    from runwatch.producer.publish.run_watch import RunWatch
    from runwatch.producer.wire.schema import (
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # AttributeError lets ``from runwatch.producer import wire`` find the subpackage
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "MemoryDelivery",
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
