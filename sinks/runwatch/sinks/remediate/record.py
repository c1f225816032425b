"""What the remediator did, as recorded: one ``Execution`` per command run or webhook post, and
``RemediationStore``, which keeps them in ClickHouse ``remediations`` (and looks up a run's
``run_start``) through a ``ClickHouseSink``, whose module holds the SQL.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson

from runwatch.contract.schema import utc_now

if TYPE_CHECKING:
    from runwatch.sinks.clickhouse import ClickHouseSink

OUTPUT_LIMIT = 4000  # characters of a command's output (its tail) or a webhook's response kept


def tail(text: str) -> str:
    return text if len(text) <= OUTPUT_LIMIT else "…" + text[-OUTPUT_LIMIT:]


@dataclass
class Execution:
    """One command run or webhook post, as recorded in ClickHouse ``remediations``."""

    action_id: str
    run_id: str
    kind: str
    target: str  # command | webhook
    target_key: str
    # ok | failed | refused | unverified | timeout | skipped (a restart with no host to leave out)
    status: str
    argv: list[str] = field(default_factory=list)
    url: str = ""
    exit_code: int | None = None  # a command's exit status; a webhook's HTTP status
    output: str = ""
    started_at: datetime = field(default_factory=utc_now)
    finished_at: datetime = field(default_factory=utc_now)
    execution_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def row(self) -> tuple[Any, ...]:
        return (
            self.execution_id,
            self.action_id,
            self.run_id,
            self.kind,
            self.target,
            self.target_key,
            self.argv,
            self.url,
            self.status,
            self.exit_code,
            self.output,
            self.started_at,
            self.finished_at,
        )


class RemediationStore:
    """The ``remediations`` table and the run metadata lookup, on a ``ClickHouseSink``."""

    def __init__(self, sink: ClickHouseSink):
        self.sink = sink

    def done_keys(self) -> set[tuple[str, str]]:
        return self.sink.runs.remediation_keys()

    def write(self, execution: Execution) -> None:
        self.sink.writer.write_remediation(execution.row())

    def run_metadata(self, run_id: str) -> dict[str, Any]:
        """The fields of the run's newest ``run_start`` (empty if none is stored, or unreadable)."""
        payload = self.sink.runs.start_payload(run_id)
        if payload is None:
            return {}
        try:
            meta = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return {}
        return meta if isinstance(meta, dict) else {}

    def executions(self, action_id: str) -> list[dict[str, Any]]:
        return self.sink.runs.remediations(action_id)
