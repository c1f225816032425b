"""The worker consumer's gaps (worker/runwatch/worker/transport.py): offsets shed by the budget, or
missing from the log, are committed past once every offset before them is acknowledged, and never before.
(Faust's own IntervalTree of gaps rebuilt itself at every gap added: a flood shed in thousands of pieces
took the consumer most of a minute per fetch.)"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from runwatch.worker.transport import Consumer

TP = ("runwatch.telemetry", 0)


def consumer(committed: int | None = None) -> SimpleNamespace:
    c = SimpleNamespace(_gaps={}, _acked=defaultdict(list), _acked_index=defaultdict(set))
    c._committed_offset = defaultdict(lambda: None, {TP: committed})
    return c


def mark(c: SimpleNamespace, begin: int, end: int) -> None:
    Consumer._mark_gap(c, TP, begin, end)  # type: ignore[arg-type]


def ack(c: SimpleNamespace, *offsets: int) -> None:
    c._acked[TP].extend(offsets)
    c._acked_index[TP].update(offsets)


def new_offset(c: SimpleNamespace) -> int | None:
    return Consumer._new_offset(c, TP)  # type: ignore[arg-type]


def test_a_shed_range_is_committed_past_only_once_what_precedes_it_is_acknowledged():
    c = consumer(committed=10)
    mark(c, 12, 20)  # 12..19 shed; 10, 11 and 20 are events still in flight
    ack(c, 20)
    assert new_offset(c) is None  # (10 and 11 are not acknowledged: nothing may be committed)
    ack(c, 10, 11)
    assert new_offset(c) == 21


def test_faust_s_gap_before_a_message_does_not_count_that_message_as_acknowledged():
    c = consumer(committed=0)
    ack(c, 0)
    mark(c, 1, 5)  # (the fetch loop: offsets 1..4 missing before the message at 5)
    ack(c, 6)  # 5 is still in flight
    assert new_offset(c) == 5
    ack(c, 5)
    assert new_offset(c) == 7


def test_adjacent_and_overlapping_gaps_merge_and_out_of_order_ones_are_kept_sorted():
    c = consumer()
    mark(c, 5, 10)
    mark(c, 10, 12)
    mark(c, 11, 15)
    mark(c, 1, 3)
    assert c._gaps[TP] == [[1, 3], [5, 15]]
    c2 = consumer(committed=8)
    mark(c2, 5, 10)  # (below the committed offset: only 8 and 9 are left)
    assert c2._gaps[TP] == [[8, 10]]


def test_a_flood_shed_in_pieces_is_committed_past_in_one_go():
    c = consumer(committed=0)
    offset = 0
    for _ in range(10_000):  # one event kept, then 20 shed, over and over
        ack(c, offset)
        mark(c, offset + 1, offset + 21)
        offset += 21
    assert len(c._gaps[TP]) == 10_000  # (a list of ranges: each added at its end, no tree rebuilt)
    ack(c, offset)
    assert new_offset(c) == offset + 1
    assert c._gaps[TP] == [] and c._acked[TP] == []
