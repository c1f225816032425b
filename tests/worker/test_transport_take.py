"""The worker takes telemetry records as fetched (worker/runwatch/worker/transport.py): Faust's fetch
loop's bookkeeping is kept (records fetched before a seek dropped, skipped offsets marked as gaps), and the
offsets are committed only once the worker settles them, never those of a revoked partition or a recreated
log (their epoch is gone)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import NamedTuple

from runwatch.contract import topics
from runwatch.worker.transport import Consumer, Settlement


class TopicPartition(NamedTuple):
    topic: str
    partition: int


TP = TopicPartition(topics.TELEMETRY, 0)
OTHER = TopicPartition(topics.ANOMALIES, 0)


def consumer(committed: int | None = None, read: int | None = None) -> SimpleNamespace:
    c = SimpleNamespace(
        _gaps={},
        _acked=defaultdict(list),
        _acked_index=defaultdict(set),
        _epochs={},
        _n_acked=0,
        _buffered_partitions=set(),
        _telemetry_at=float("-inf"),
        flow_active=True,
        app=SimpleNamespace(monitor=SimpleNamespace(stream_inbound_time={})),
    )
    c._committed_offset = defaultdict(lambda: None, {TP: committed})
    c._read_offset = defaultdict(lambda: None, {TP: read})
    c._mark_gap = lambda tp, begin, end: Consumer._mark_gap(c, tp, begin, end)  # type: ignore[arg-type]
    return c


def records(*offsets: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(offset=o, key=b"k", value=b"{}", timestamp=0) for o in offsets]


def take(c: SimpleNamespace, fetched: dict) -> list:
    return Consumer._take(c, fetched, None)  # type: ignore[arg-type]


def new_offset(c: SimpleNamespace) -> int | None:
    return Consumer._new_offset(c, TP)  # type: ignore[arg-type]


def test_taken_records_leave_faust_s_batch_and_commit_only_once_settled():
    c = consumer(committed=10, read=10)
    fetched = {TP: records(9, 10, 11, 14), OTHER: records(3)}
    taken = take(c, fetched)
    assert list(fetched) == [OTHER]  # (other topics still go to Faust's streams)
    assert [r.offset for r in taken[0].records] == [10, 11, 14]  # 9: fetched before the seek to 10
    assert c._read_offset[TP] == 14
    assert c._gaps[TP] == [[12, 14]]  # missing from the log, as Faust's fetch loop marks them
    assert new_offset(c) is None  # nothing settled: nothing may be committed
    Consumer.settle(c, [Settlement(TP, taken[0].epoch, [10, 11])])  # type: ignore[arg-type]
    assert new_offset(c) == 12  # 14 is still in flight
    c._committed_offset[TP] = 12  # (Faust's commit)
    Consumer.settle(c, [Settlement(TP, taken[0].epoch, [14])])  # type: ignore[arg-type]
    assert new_offset(c) == 15


def test_records_of_a_bookkeeping_gone_since_settle_nothing():
    c = consumer(committed=0, read=0)
    taken = take(c, {TP: records(0, 1, 2)})
    c._epochs[TP] = taken[0].epoch + 1  # revoked, or its log recreated (forget_positions)
    Consumer.settle(c, [Settlement(TP, taken[0].epoch, [0, 1, 2])])  # type: ignore[arg-type]
    assert new_offset(c) is None


def test_nothing_is_taken_while_the_flow_is_stopped_for_a_revoke():
    c = consumer(committed=0, read=0)
    c.flow_active = False
    fetched = {TP: records(0, 1)}
    assert take(c, fetched) == []
    assert fetched == {}  # (dropped, as Faust drops them: the partition is read again from its commit)
    assert c._read_offset[TP] == 0
