"""What the state tests share (tests/worker/test_state_snapshots.py, test_state_run_moves.py,
test_state_reader.py, test_run_ledgers.py): the keys, the clocks, and ``Store``, an in-memory stand-in
for the compacted state topic and the finding topics a successor reads back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runwatch.contract import topics
from runwatch.worker.processor import ProcessResult, StateRecord
from tests.support.action_keys import SEED

SECRET = SEED  # the codec tests sign with it; processors sign actions with it
STATE_SECRET = b"unit-test-state-key-at-least-32-bytes-456"
T0 = datetime(2024, 5, 1, 12, tzinfo=UTC)
WALL = T0 + timedelta(days=1)  # the worker clock: events within 7 days before it are in the time window


class Store:
    """What the compacted topic holds after compaction: the newest value per key and partition; and
    the anomaly and action topics, as a successor scans them (StateReader.scan)."""

    def __init__(self) -> None:
        self.partitions: dict[int, dict[str, bytes | None]] = {}
        self.published: dict[str, list[tuple[bytes, bytes]]] = {topics.ANOMALIES: [], topics.ACTIONS: []}

    def publish(self, result: ProcessResult) -> None:
        self.published[topics.ANOMALIES] += [(a.run_id.encode(), a.to_json()) for a in result.anomalies]
        self.published[topics.ACTIONS] += [(a.run_id.encode(), a.to_json()) for a in result.actions]

    def scan(self, topic: str, partitions: object, tail: int | None, timeout_s: float | None = None):
        return iter(self.published[topic][-tail:] if tail else self.published[topic])

    def write(self, records: list[StateRecord]) -> None:
        for r in records:
            self.partitions.setdefault(r.partition, {})[r.key] = r.value

    topic = topics.STATE
    origin: dict[str, tuple[int, int]] = {}  # (StateReader's: where each record read is; not kept here)

    def read(self, partitions: set[int]) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        for p in sorted(partitions):
            out.update(self.partitions.get(p, {}))
        return out
