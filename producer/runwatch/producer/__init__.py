"""What training code imports: the wire schema, the publisher (and its offline twin, the JSONL
recorder), torch instrumentation and the action listener.

Never imports Faust, river or ClickHouse; torch only lazily, where it is used. The names below
load their modules on first use; the wire contract is a room of its own (``runwatch.contract``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Lazy (PEP 562): importing any submodule runs this file, and a light one (the checkpoints helper, the
# integrations' glue) must not load the publisher, the watcher, the action listener or torch.
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
    "Action": "runwatch.contract.schema",
    "ActionAckEvent": "runwatch.contract.schema",
    "Anomaly": "runwatch.contract.schema",
    "CheckpointEvent": "runwatch.contract.schema",
    "CheckpointRef": "runwatch.contract.schema",
    "EvalEvent": "runwatch.contract.schema",
    "HeartbeatEvent": "runwatch.contract.schema",
    "RunEndEvent": "runwatch.contract.schema",
    "RunStartEvent": "runwatch.contract.schema",
    "SchemaError": "runwatch.contract.schema",
    "StepEvent": "runwatch.contract.schema",
    "decode_event": "runwatch.contract.schema",
    "Watcher": "instrument.watch",
}

if TYPE_CHECKING:
    from runwatch.contract.schema import (
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
    from runwatch.producer.actions.apply import AppliedAction
    from runwatch.producer.actions.checkpoints import save_checkpoint
    from runwatch.producer.actions.listener import ActionListener
    from runwatch.producer.instrument.categories import CategoryLossBatch, category_loss
    from runwatch.producer.instrument.heartbeat import Heartbeat
    from runwatch.producer.instrument.watch import Watcher
    from runwatch.producer.publish.delivery import MemoryDelivery, PublisherStats
    from runwatch.producer.publish.recorder import JsonlRecorder
    from runwatch.producer.publish.run_watch import RunWatch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # AttributeError lets ``from runwatch.producer import actions`` find the subpackage
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(
        importlib.import_module(
            module if "." in module and module.startswith("runwatch.") else f"{__name__}.{module}"
        ),
        name,
    )
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
