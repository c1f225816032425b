"""Per-run state snapshots (issue 16), without a broker: the record codec, when snapshots are due,
and the processor's results being the same whichever processor holds a run and however often it
moves (cut anywhere, restored from the snapshots written so far, the backlog replayed from the last
checkpoint)."""

from __future__ import annotations

import json
import random
import time
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import (
    ActionAckEvent,
    CheckpointEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import ProcessResult, StateRecord, TelemetryProcessor
from runwatch.worker.state.run_states import RunStates, StateOptions
from runwatch.worker.state.snapshot import (
    SnapshotError,
    SnapshotHeader,
    decode_body,
    decode_header,
    encode_snapshot,
)
from tests.support.action_keys import SEED

SECRET = SEED  # the codec tests sign with it; processors sign actions with it
STATE_SECRET = b"unit-test-state-key-at-least-32-bytes-456"
T0 = datetime(2024, 5, 1, 12, tzinfo=UTC)
WALL = T0 + timedelta(days=1)  # the worker clock: events within 7 days before it are in the time window


def _header(**fields) -> SnapshotHeader:
    base = {"run_id": "r", "partition": 2, "offset": 41, "events": 7, "taken_at": WALL, "config_sha": "c"}
    return SnapshotHeader.model_validate({**base, **fields})


# -- the codec -------------------------------------------------------------------------------------


def test_a_snapshot_decodes_to_its_header_and_state():
    raw = encode_snapshot(_header(), {"x": [1, 2, 3]}, SECRET)
    header, body = decode_header(raw, SECRET)
    assert header == _header()
    assert decode_body(body) == {"x": [1, 2, 3]}
    marker, empty = decode_header(encode_snapshot(_header(ended_at=WALL), None, SECRET), SECRET)
    assert marker.ended_at == WALL and decode_body(empty) is None


@pytest.mark.parametrize(
    "corrupt, says",
    [
        (lambda raw: b"XXXX" + raw[4:], "bad magic"),
        (lambda raw: raw[:4] + bytes(32) + raw[36:], "not signed"),
        (lambda raw: raw[:-5], "not signed"),  # cut: the signature no longer matches
        (lambda raw: b"", "bad magic"),
    ],
)
def test_a_damaged_or_foreign_record_is_refused_before_anything_is_unpickled(corrupt, says):
    raw = encode_snapshot(_header(), {"x": 1}, SECRET)
    with pytest.raises(SnapshotError, match=says):
        decode_header(corrupt(raw), SECRET)
    with pytest.raises(SnapshotError, match="not signed"):
        decode_header(raw, b"another-secret-of-at-least-32-bytes-xxxxx")


def test_a_signed_record_whose_body_does_not_unpickle_is_refused():
    import hmac
    import struct

    head = _header().model_dump_json().encode()
    signed = struct.pack(">I", len(head)) + head + b"not zlib at all"
    raw = b"RWS1" + hmac.digest(SECRET, signed, "sha256") + signed
    header, body = decode_header(raw, SECRET)
    with pytest.raises(SnapshotError, match="body cannot be read"):
        decode_body(body)


# -- when snapshots are due ------------------------------------------------------------------------


class Clocks:
    def __init__(self) -> None:
        self.wall = WALL
        self.perf = 0.0


def _states(**options) -> tuple[RunStates, Clocks]:
    clocks = Clocks()
    return RunStates(StateOptions(**options), lambda: clocks.wall, lambda: clocks.perf), clocks


def test_a_run_that_emitted_is_snapshotted_at_once_and_the_others_at_the_checkpoint():
    states, clocks = _states(every_events=3, interval_s=5)
    states.observed("quiet", 0, 10, emitted=False)
    states.observed("loud", 1, 11, emitted=True)
    due = states.due()
    assert due.runs == ["loud"] and not due.checkpoint
    states.written("loud")
    for offset in (12, 13):
        states.observed("quiet", 0, offset, emitted=False)
    assert states.due().runs == ["quiet"]  # its third event since the last snapshot
    states.written("quiet")
    states.observed("quiet", 0, 14, emitted=False)
    assert states.due().runs == []
    clocks.perf = 5.0
    due = states.due()
    assert due.checkpoint and due.runs == ["quiet"]  # only what changed since its last snapshot
    states.written("quiet")
    assert states.due(force_checkpoint=True) == type(due)([], [], [], True)


def test_an_ended_run_leaves_a_marker_then_a_tombstone_after_the_retention():
    states, clocks = _states(retention_s=60)
    states.observed("r", 3, 5, emitted=False)
    states.ended_run("r")
    due = states.due()
    assert due.runs == [] and due.markers == [("r", 3, WALL)] and due.tombstones == []
    clocks.wall += timedelta(seconds=59)
    assert states.due(force_checkpoint=True).tombstones == []
    clocks.wall += timedelta(seconds=2)
    assert states.due(force_checkpoint=True).tombstones == [("r", 3)]
    assert states.due(force_checkpoint=True).tombstones == []  # once


def test_a_reset_run_is_deleted_and_a_moved_one_is_left_to_its_new_owner():
    states, _ = _states()
    states.observed("reset", 0, 1, emitted=True)
    states.observed("moved", 1, 2, emitted=True)
    states.dropped("reset")
    states.moved("moved")
    due = states.due(force_checkpoint=True)
    assert due.runs == [] and due.tombstones == [("reset", 0)] and due.markers == []


def test_a_restored_run_skips_exactly_the_events_its_snapshot_holds():
    states, _ = _states()
    states.restored("r", partition=2, offset=41)
    assert states.already_seen("r", 2, 41) and states.already_seen("r", 2, 0)
    assert not states.already_seen("r", 2, 42)
    assert not states.already_seen("r", 1, 41)  # (another partition's offsets are another count)
    assert not states.already_seen("other", 2, 3)


# -- the same results however often a run moves ----------------------------------------------------


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


CONFIG = RunwatchConfig.model_validate({"policy": {"confirm_steps": 12}})


def _stream(seed: int = 7) -> list[tuple[int, int, bytes]]:
    """(partition, offset, raw) in arrival order: three runs on two partitions, two ranks each, noisy
    steps, checkpoints, a loss spike, four NaN steps that roll back (acknowledged, the steps replayed), a run
    end."""
    rng = random.Random(seed)
    by_run: dict[str, list[bytes]] = {}
    for run_id, fault in (("run-a", "spike"), ("run-b", "nan"), ("run-c", None)):
        events: list[bytes] = [
            RunStartEvent(run_id=run_id, world_size=2, ts=T0, event_id=f"{run_id}-start").to_json()
        ]
        t = 0
        steps = list(range(0, 80))
        if fault == "nan":
            steps = list(range(0, 56)) + list(range(41, 80))  # rolled back to 40 after the NaN at 55
        for i, step in enumerate(steps):
            t += 1
            for rank in (0, 1):
                loss = 2.0 * 0.99**step + rng.gauss(0, 0.02)
                if fault == "spike" and step == 50:
                    loss *= 6
                if fault == "nan" and 52 <= step <= 55 and i < 56:
                    loss = float("nan")
                events.append(
                    StepEvent(
                        run_id=run_id,
                        rank=rank,
                        step=step,
                        loss=loss,
                        grad_norm=1.0 + rng.gauss(0, 0.05),
                        step_time_s=0.1 + rng.gauss(0, 0.003),
                        ts=T0 + timedelta(seconds=t),
                        event_id=f"{run_id}-{i}-{rank}",
                    ).to_json()
                )
            if step % 10 == 0 and step > 0 and i < 56:
                events.append(
                    CheckpointEvent(
                        run_id=run_id,
                        step=step,
                        uri=f"/c/{step}",
                        ts=T0 + timedelta(seconds=t),
                        event_id=f"{run_id}-ckpt-{i}",
                    ).to_json()
                )
            if fault == "nan" and i == 56:
                events.append(
                    ActionAckEvent(
                        run_id=run_id,
                        action_id="filled-below",
                        outcome="applied",
                        step=55,
                        to_step=40,
                        ts=T0 + timedelta(seconds=t),
                        event_id=f"{run_id}-ack",
                    ).to_json()
                )
        if run_id == "run-c":
            events.append(
                RunEndEvent(
                    run_id=run_id, ts=T0 + timedelta(seconds=t + 1), event_id=f"{run_id}-end"
                ).to_json()
            )
        by_run[run_id] = events
    partition_of = {"run-a": 0, "run-b": 1, "run-c": 0}
    offsets = {0: 0, 1: 0}
    out = []
    cursors = dict.fromkeys(by_run, 0)
    while any(cursors[r] < len(by_run[r]) for r in by_run):
        run_id = rng.choice([r for r in by_run if cursors[r] < len(by_run[r])])
        p = partition_of[run_id]
        out.append((p, offsets[p], by_run[run_id][cursors[run_id]]))
        offsets[p] += 1
        cursors[run_id] += 1
    return out


def _with_rollback_ack(stream: list[tuple[int, int, bytes]], action_id: str) -> list[tuple[int, int, bytes]]:
    return [(p, o, raw.replace(b'"filled-below"', json.dumps(action_id).encode())) for p, o, raw in stream]


def _findings(results: list[ProcessResult]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Anomalies by id (their content, without detected_at) and actions by id (every copy issued)."""
    anomalies: dict[str, str] = {}
    actions: dict[str, list[str]] = {}
    for result in results:
        for a in result.anomalies:
            body = a.model_dump_json(exclude={"detected_at"})
            assert anomalies.setdefault(a.anomaly_id, body) == body, f"{a.anomaly_id} came back changed"
        for act in result.actions:
            actions.setdefault(act.action_id, []).append(
                act.model_dump_json(exclude={"issued_at", "expires_at", "signature"})
            )
    return anomalies, actions


def _processor(store: Store, wall: datetime = WALL) -> TelemetryProcessor:
    return TelemetryProcessor(
        CONFIG,
        SECRET,
        clock=lambda: wall,
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=25, interval_s=1e9),
        state_secret=STATE_SECRET,
    )


def _run(
    stream, cuts: set[int], batch: int = 10, snapshot_lost: bool = False
) -> tuple[list[ProcessResult], int]:
    """Feed ``stream`` in batches, as the worker does; at each cut index the processor is lost and a new
    one restores from the store and reads again from the last checkpoint. ``snapshot_lost``: the batch
    before each cut had its results published but its snapshots never reached the store (the worker
    died between the two). Returns the results and how many runs were restored in all."""
    store = Store()
    proc = _processor(store)
    proc.keep_partitions({0, 1})
    results: list[ProcessResult] = []
    committed = 0  # index of the first event not covered by a delivered checkpoint
    i = 0
    pending = sorted(cuts)
    restored = 0
    while i < len(stream):
        if pending and i >= pending[0]:
            pending.pop(0)
            restored += proc.counters.restored_runs
            proc = _processor(store)  # the successor: nothing in memory
            proc.keep_partitions({0, 1})
            i = committed
            continue
        chunk = stream[i : min(i + batch, pending[0] if pending else len(stream))]
        for p, o, raw in chunk:
            results.append(proc.process(raw, key=json.loads(raw)["run_id"].encode(), partition=p, offset=o))
            store.publish(results[-1])
        checkpoint_now = (i // batch) % 3 == 2  # every third batch, as the interval would
        records, checkpoint = proc.take_snapshots(force_checkpoint=checkpoint_now)
        i += len(chunk)
        if snapshot_lost and pending and i == pending[0]:
            continue
        store.write(records)
        if checkpoint:
            committed = i
    return results, restored + proc.counters.restored_runs


def test_results_are_the_same_whichever_processor_holds_the_run_and_however_often_it_moves():
    draft = _stream()
    first, _ = _run(draft, set())
    rollbacks = [a for r in first for a in r.actions if a.kind == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].run_id == "run-b"
    stream = _with_rollback_ack(draft, rollbacks[0].action_id)

    uninterrupted, _ = _run(stream, set())
    want_anomalies, want_actions = _findings(uninterrupted)
    assert {a.split("|")[0] for a in want_actions} and len(want_anomalies) >= 2
    detectors = {json.loads(v)["detector"] for v in want_anomalies.values()}
    assert {"non_finite", "loss_spike"} <= detectors, detectors

    # lost right after each action was issued (before a checkpoint covered it), and at assorted places
    right_after = {i + 1 for i, r in enumerate(uninterrupted) if r.actions}
    for cuts in (
        right_after,
        {45},
        {101, 230},
        {17, 64, 65, 150, 260, 330, 400},
        set(range(20, len(stream), 37)),
    ):
        moved, restored = _run(stream, cuts)
        anomalies, actions = _findings(moved)
        assert anomalies == want_anomalies, cuts
        assert {k: v[:1] for k, v in actions.items()} == {k: v[:1] for k, v in want_actions.items()}, cuts
        # an action is issued once: it is snapshotted with the state that decided it
        assert all(len(copies) == 1 for copies in actions.values()), cuts
        assert restored >= 2 * len(cuts), (
            cuts,
            restored,
        )  # (each successor restored the runs, not rebuilt them)


def test_a_successor_does_not_issue_again_what_its_predecessor_published_after_its_last_snapshot():
    """The worker died after the broker took an action and before it took the snapshot sent after it:
    the successor restores the snapshot before, replays, decides the action again, and finds it
    already on the action topic (worker/runwatch/worker/state/published.py). Without that read it is issued
    twice."""
    draft = _stream()
    first, _ = _run(draft, set())
    stream = _with_rollback_ack(
        draft, next(a for r in first for a in r.actions if a.kind == "rollback").action_id
    )
    uninterrupted, _ = _run(stream, set())
    want_anomalies, want_actions = _findings(uninterrupted)
    right_after = {i + 1 for i, r in enumerate(uninterrupted) if r.actions or r.anomalies}
    moved, _ = _run(stream, right_after, batch=1, snapshot_lost=True)
    anomalies, actions = _findings(moved)
    assert anomalies == want_anomalies
    assert {k: v[:1] for k, v in actions.items()} == {k: v[:1] for k, v in want_actions.items()}
    assert all(len(copies) == 1 for copies in actions.values()), {k: len(v) for k, v in actions.items()}
    anomaly_copies = [a.anomaly_id for r in moved for a in r.anomalies]
    assert len(anomaly_copies) == len(set(anomaly_copies))  # (no finding published twice either)


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


def test_a_restored_run_keeps_its_baseline_band_and_the_history_its_end_is_judged_against():
    from runwatch.detectors.baseline_trajectory import BaselineTrajectoryDetector, hand_band
    from runwatch.detectors.baselines.summary import RunSummarizer
    from tests.detectors.test_baseline_trajectory import BAND, run  # a band of five seeded runs of one job

    store = Store()
    events = run(9, run_id="live")
    wall = events[-1].ts + timedelta(hours=1)
    first = _processor(store, wall)
    first.keep_partitions({0})
    first.process(RunStartEvent(run_id="live", ts=events[0].ts).to_json(), key=b"live", partition=0, offset=0)
    monitor = first.monitors["live"]
    history = [RunSummarizer(f"old-{i}").summary() for i in range(3)]
    monitor.set_history(history, None)  # what the worker's BaselineLoader hands over at run_start
    hand_band(monitor.joined_detectors, BAND, None)
    for offset, event in enumerate(events[:50], start=1):
        first.process(event.to_json(), key=b"live", partition=0, offset=offset)
    records, _ = first.take_snapshots(force_checkpoint=True)
    store.write(records)

    second = _processor(store, wall)
    second.keep_partitions({0})
    restored = second.monitors["live"]
    assert [s.run_id for s in restored.baseline.candidates] == ["old-0", "old-1", "old-2"]
    (trajectory,) = [d for d in restored.joined_detectors if isinstance(d, BaselineTrajectoryDetector)]
    (before,) = [d for d in monitor.joined_detectors if isinstance(d, BaselineTrajectoryDetector)]
    assert trajectory._band.names == before._band.names and trajectory._band.names
    import numpy as np

    assert np.array_equal(trajectory._band.thr, before._band.thr, equal_nan=True)


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


def test_a_run_let_go_has_its_snapshot_deleted_so_no_successor_restores_it():
    store = Store()
    wall = [WALL]
    config = RunwatchConfig.model_validate(
        {"runs": {"silence_retention_s": 60, "max_runs": 2}, "policy": {"confirm_steps": 12}}
    )
    proc = TelemetryProcessor(
        config,
        SECRET,
        clock=lambda: wall[0],
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=25, interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    proc.keep_partitions({0})
    for i, run in enumerate(("crashed", "evicted", "live")):
        wall[0] = WALL + timedelta(seconds=i)
        ts = WALL - timedelta(seconds=10)
        proc.process(
            StepEvent(run_id=run, step=1, loss=1.0, ts=ts).to_json(), key=run.encode(), partition=0, offset=i
        )
        if i == 1:
            store.write(proc.take_snapshots(force_checkpoint=True)[0])  # both snapshotted...
    assert {"crashed", "evicted"} <= {k.split("/", 1)[1] for k in store.read({0})}
    # ... then "crashed" was evicted to make room for "live" (max_runs 2); "evicted" goes silent
    wall[0] = WALL + timedelta(seconds=62)
    proc.process(
        StepEvent(run_id="live", step=2, loss=1.0, ts=WALL).to_json(), key=b"live", partition=0, offset=3
    )
    let_go = proc.tick(wall[0]).anomalies
    assert [(a.run_id, a.metric) for a in let_go] == [("evicted", "silent")]
    store.write(proc.take_snapshots(force_checkpoint=True)[0])
    held = {k.split("/", 1)[1]: v for k, v in store.read({0}).items()}
    assert held["crashed"] is None and held["evicted"] is None and held["live"] is not None  # tombstones
    successor = TelemetryProcessor(
        config,
        SECRET,
        clock=lambda: wall[0],
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=25, interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    successor.keep_partitions({0})
    assert set(successor.monitors) == {"live"}


def test_a_replay_marker_is_one_partition_s_offset():
    """Issue 23, case 7: a stray record of a run on another partition at a high offset became the run's
    replay marker, and after a restart its own events below that offset were skipped. (The worker now
    refuses a record off its key's partition; without the partition count the marker still holds.)"""
    states, _ = _states()
    states.observed("r", 1, 5, emitted=False)
    states.observed("r", 3, 900, emitted=False)  # the stray record
    states.observed("r", 1, 6, emitted=False)
    assert (states.runs["r"].partition, states.runs["r"].last_offset) == (1, 6)
