"""One ``Sink`` base for the ClickHouse sink and the remediator (sinks/runwatch/sinks/base.py): the loop
commits a partition only up to the first offset its sink says is not yet durable, reads it again from
there, and so loses nothing; a batch written whole is committed whole."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from runwatch.sinks.base import Partition, Record, Sink, first_offsets
from runwatch.sinks.consumer import SinkConsumer
from runwatch.sinks.loop import ConsumeLoop
from runwatch.sinks.remediate.consumer import RemediateConsumer


def record(topic: str, partition: int, offset: int) -> SimpleNamespace:
    return SimpleNamespace(
        topic=topic,
        partition=partition,
        offset=offset,
        key=b"k",
        value=f"{topic}{partition}@{offset}",
        timestamp=None,
    )


class MemoryConsumer:
    """A Kafka consumer over records held in memory: poll from each partition's position, seek, commit."""

    def __init__(self, records: dict[Partition, int]):
        self.records = {key: [record(*key, o) for o in range(n)] for key, n in records.items()}
        self.position = dict.fromkeys(records, 0)
        self.commits: list[dict[Partition, int]] = []
        self.closed = False

    def poll(self, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
        out: dict[Any, list[Any]] = {}
        for key, rs in self.records.items():
            got = rs[self.position[key] : self.position[key] + max_records]
            if got:
                out[key] = got
                self.position[key] += len(got)
        return out

    def assignment(self) -> set[Partition]:
        return set(self.records)

    def seek(self, tp: Any, offset: int) -> None:
        self.position[(tp.topic, tp.partition)] = offset

    def commit(self, offsets: Mapping[Any, Any], timeout_ms: int | None) -> None:
        self.commits.append({(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()})

    def close(self) -> None:
        self.closed = True


class FlakyStore(Sink):
    """Durable at once, except one partition whose records from ``stuck_at`` are not, the first
    ``failures`` times they come."""

    label = "test sink"

    def __init__(self, stuck: Partition, stuck_at: int, failures: int, total: int):
        super().__init__()
        self.stuck, self.stuck_at, self.failures, self.total = stuck, stuck_at, failures, total
        self.durable: set[tuple[str, int, int]] = set()
        self.writes: list[str] = []
        self.committed_upto: list[dict[Partition, int]] = []

    def write_batch(self, records: Sequence[Record]) -> dict[Partition, int]:
        not_durable = []
        for r in records:
            self.writes.append(r.value)
            if (r.topic, r.partition) == self.stuck and r.offset >= self.stuck_at and self.failures > 0:
                not_durable.append(r)
            else:
                self.durable.add((r.topic, r.partition, r.offset))
        if not_durable:
            self.failures -= 1
        if len(self.durable) == self.total:
            self.stopping.set()
        return first_offsets(not_durable)

    def committed(self, upto: Mapping[Partition, int]) -> None:
        # every offset below a commit is durable at that moment
        for (topic, partition), offset in upto.items():
            assert all((topic, partition, o) in self.durable for o in range(offset)), (
                topic,
                partition,
                offset,
            )
        self.committed_upto.append(dict(upto))


def test_a_partition_is_committed_only_to_its_first_record_not_yet_durable_and_read_again_from_there():
    consumer = MemoryConsumer({("t", 0): 8, ("t", 1): 5})
    store = FlakyStore(stuck=("t", 0), stuck_at=3, failures=2, total=13)
    loop = ConsumeLoop(store, batch_size=100)
    loop.rewind_delay = 0.01
    loop.run(consumer)

    assert store.durable == {("t", 0, o) for o in range(8)} | {("t", 1, o) for o in range(5)}  # none lost
    first = consumer.commits[0]
    assert first == {("t", 0): 3, ("t", 1): 5}  # the stuck partition to its first record not durable
    assert consumer.commits[-1] == {("t", 0): 8}  # then, once they are, all of it
    assert [c[("t", 0)] for c in consumer.commits] == [3, 3, 8]  # never past what is durable
    assert store.writes.count("t0@3") == 3 and store.writes.count("t0@2") == 1  # read again from there
    assert store.committed_upto == consumer.commits and consumer.closed


def test_a_batch_written_whole_is_committed_whole_in_one_commit():
    consumer = MemoryConsumer({("a", 0): 4, ("b", 2): 3})
    store = FlakyStore(stuck=("a", 0), stuck_at=0, failures=0, total=7)
    ConsumeLoop(store, batch_size=100).run(consumer)
    assert consumer.commits == [{("a", 0): 4, ("b", 2): 3}]


def test_first_offsets_are_the_lowest_per_partition():
    records = [record("t", 0, 7), record("t", 1, 2), record("t", 0, 4), record("u", 0, 9)]
    assert first_offsets(records) == {("t", 0): 4, ("t", 1): 2, ("u", 0): 9}
    assert first_offsets([]) == {}


def test_the_clickhouse_sink_and_the_remediator_are_both_sinks():
    assert issubclass(SinkConsumer, Sink) and issubclass(RemediateConsumer, Sink)
    assert SinkConsumer.write_batch is not Sink.write_batch
    assert RemediateConsumer.write_batch is not Sink.write_batch
