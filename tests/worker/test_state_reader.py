"""Reading state back, without a broker: a compacted partition (gaps, tombstones, a cleaned tail, a log
start that moves, a partition starved behind another's backlog) is read to its end, keeping each run's
newest record; a slow read of the published findings gives up at its budget and keeps what it read."""

from __future__ import annotations

import time
from datetime import timedelta

from runwatch.contract import topics
from tests.support.state_store import T0

# -- reading a compacted partition back ------------------------------------------------------------


class _Record:
    def __init__(self, offset: int, key: bytes, value: bytes | None):
        self.offset, self.key, self.value = offset, key, value


class CompactedLog:
    """A kafka-python consumer over partitions as a compacted (and cleaned) log leaves them: offsets
    with gaps, tombstones, a log start above 0, a tail the cleaner emptied (fetches return nothing below
    the end offset), a log start that retention moves during the read."""

    def __init__(
        self, partitions: dict[int, tuple[int, int, list[_Record]]], move_start_after_polls: int = 0
    ):
        self.partitions = partitions  # partition -> (log start, end offset, records)
        self.position_of: dict = {}
        self.polls = 0
        self.move_start_after_polls = move_start_after_polls

    def assign(self, tps):
        self.assigned = list(tps)

    def beginning_offsets(self, tps):
        return {tp: self.partitions[tp.partition][0] for tp in tps}

    def end_offsets(self, tps):
        return {tp: self.partitions[tp.partition][1] for tp in tps}

    def seek(self, tp, offset):
        self.position_of[tp] = offset

    def position(self, tp):
        return self.position_of[tp]

    def highwater(self, tp):  # the broker has answered a fetch of the partition
        return self.partitions[tp.partition][1]

    def poll(self, timeout_ms: int, max_records: int):
        self.polls += 1
        out = {}
        for tp in self.assigned:
            start, end, records = self.partitions[tp.partition]
            if self.move_start_after_polls and self.polls > self.move_start_after_polls:
                start = end - 1  # retention deleted all but the last offset meanwhile
                records = [r for r in records if r.offset >= start]
            if self.position_of.get(tp, start) < start:
                self.position_of[tp] = start  # auto_offset_reset="earliest"
            got = [r for r in records if r.offset >= self.position_of[tp]][:2]  # two at a time
            if got:
                out[tp] = got
                self.position_of[tp] = got[-1].offset + 1
        return out


def test_reading_a_compacted_partition_keeps_each_run_s_newest_record_and_forgets_tombstoned_ones():
    from runwatch.worker.state.reader import StateReader

    log = CompactedLog(
        {
            0: (
                3,
                20,
                [
                    _Record(3, b"g/a", b"a1"),
                    _Record(7, b"g/b", b"b1"),
                    _Record(9, b"g/a", b"a2"),
                    _Record(12, b"g/b", None),
                    _Record(15, b"g/c", b"c1"),
                ],
            ),  # 16..19 cleaned away
            1: (5, 5, []),  # empty: nothing was ever kept
        }
    )
    reader = StateReader("unused:9092", consumer=log, idle_s=0.2, timeout_s=10)
    assert reader.read({0, 1}) == {"g/a": b"a2", "g/b": None, "g/c": b"c1"}


class StarvedLog(CompactedLog):
    """A slow broker (a poll every 0.1 s) where partition 1's fetches wait behind partition 0's backlog:
    nothing of partition 1 arrives until ``after_s`` past partition 0's last record."""

    def __init__(self, partitions, after_s: float):
        super().__init__(partitions)
        self.after_s = after_s
        self.backlog_done: float | None = None

    def poll(self, timeout_ms: int, max_records: int):
        time.sleep(0.1)
        out = super().poll(timeout_ms, max_records)
        for tp in list(out):
            if tp.partition == 0 and self.position_of[tp] >= self.partitions[0][1]:
                self.backlog_done = time.monotonic()
            if tp.partition == 1 and (
                self.backlog_done is None or time.monotonic() < self.backlog_done + self.after_s
            ):
                self.position_of[tp] -= len(out.pop(tp))  # not delivered yet
        return out


def test_a_partition_starved_behind_another_s_backlog_is_read_to_its_end():
    """Issue 23, case 5: under load one partition's fetches came back empty for the idle time while
    another's backlog was read, and the reader took it for a cleaned tail: its snapshots were dropped."""
    from runwatch.worker.state.reader import StateReader

    backlog = [_Record(i, f"g/r{i}".encode(), b"v") for i in range(30)]  # two a poll: about 1.5 s
    starved = [_Record(i, f"g/s{i}".encode(), b"w") for i in range(4)]
    log = StarvedLog({0: (0, 30, backlog), 1: (0, 4, starved)}, after_s=0.25)
    progress: list[int] = []
    reader = StateReader("unused:9092", consumer=log, idle_s=0.2, timeout_s=10)
    reader.on_progress = progress.append
    got = reader.read({0, 1})
    assert sorted(got) == sorted([f"g/r{i}" for i in range(30)] + [f"g/s{i}" for i in range(4)])
    assert progress and progress == sorted(progress)  # reported as it went


def test_reading_while_retention_moves_the_log_start_ends_at_the_new_start():
    from runwatch.worker.state.reader import StateReader

    records = [_Record(i, f"g/r{i % 4}".encode(), f"v{i}".encode()) for i in range(0, 30)]
    log = CompactedLog({2: (0, 30, records)}, move_start_after_polls=2)
    reader = StateReader("unused:9092", consumer=log, idle_s=0.2, timeout_s=10)
    # two polls read offsets 0..3, then the start jumps to 29: the read goes on from there and ends
    assert reader.read({2}) == {"g/r0": b"v0", "g/r1": b"v29", "g/r2": b"v2", "g/r3": b"v3"}
    assert log.polls < 10


# -- reading the published findings back -----------------------------------------------------------


def test_a_slow_read_of_what_was_published_is_logged_and_what_was_read_is_used(caplog):
    """The published tail is read inside the reply the worker waits for: past its budget it gives up
    with a warning instead of failing the worker, keeping what it read by then."""
    from runwatch.contract.schema import Anomaly
    from runwatch.worker.state.published import read_published
    from runwatch.worker.state.reader import StateReadError

    found = Anomaly(
        anomaly_id="a1",
        run_id="run-a",
        detector="loss_spike",
        metric="loss",
        severity="warning",
        message="loss spiked",
        ts=T0,
    )
    budgets = []

    def slow_scan(topic, partitions, tail, timeout_s):
        budgets.append(timeout_s)
        if topic == topics.ANOMALIES:
            yield b"run-a", found.to_json()
            yield b"run-b", found.model_copy(update={"anomaly_id": "b1", "run_id": "run-b"}).to_json()
        raise StateReadError(f"reading {topic} partitions [0] took over {timeout_s:g} s")

    with caplog.at_level("WARNING", logger="runwatch.worker"):
        published = read_published(slow_scan, ["run-a"], budget_s=0.5)
    assert budgets == [0.5, 0.5]
    assert published.is_repeat(found.model_copy(update={"detected_at": T0 + timedelta(seconds=1)}))
    assert not published.is_repeat(found.model_copy(update={"severity": "critical"}))  # an update is sent
    assert len(published) == 1  # run-b was not restored here
    assert [r.message.split(":")[0] for r in caplog.records] == [topics.ANOMALIES, topics.ACTIONS]
