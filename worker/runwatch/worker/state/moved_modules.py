"""Modules a snapshot may name that have moved since it was taken (issue 41: the wire contract left the
producer, the worker left ``streams``). A worker upgraded under running jobs reads their snapshots: a class
named at its old module is looked up at its new one, and admitted only by the rules that admit it there
(classes.py)."""

from __future__ import annotations

MOVED_MODULES: dict[str, str] = {
    "runwatch.producer.wire.schema": "runwatch.contract.schema",
    "runwatch.producer.wire.group_report": "runwatch.contract.group_report",
    "runwatch.streams.worker.processor": "runwatch.worker.processor",
}
