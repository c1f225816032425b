"""Per-run state snapshots (issue 16), without a broker: the record codec (damaged and foreign records
are refused before anything is unpickled), and when snapshots, end markers and tombstones are due."""

from __future__ import annotations

from datetime import timedelta

import pytest

from runwatch.worker.state.run_states import RunStates, StateOptions
from runwatch.worker.state.snapshot import (
    SnapshotError,
    SnapshotHeader,
    decode_body,
    decode_header,
    encode_snapshot,
)
from tests.support.state_store import SECRET, WALL


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


def test_a_replay_marker_is_one_partition_s_offset():
    """Issue 23, case 7: a stray record of a run on another partition at a high offset became the run's
    replay marker, and after a restart its own events below that offset were skipped. (The worker now
    refuses a record off its key's partition; without the partition count the marker still holds.)"""
    states, _ = _states()
    states.observed("r", 1, 5, emitted=False)
    states.observed("r", 3, 900, emitted=False)  # the stray record
    states.observed("r", 1, 6, emitted=False)
    assert (states.runs["r"].partition, states.runs["r"].last_offset) == (1, 6)
