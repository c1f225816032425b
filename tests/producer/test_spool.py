"""The disk spool: bound and overflow policy both ways, order, commit, restart recovery, a torn
tail; and RunWatch with no broker spooling instead of dropping, with exact books."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from runwatch.producer.publish.kafka_delivery import default_spool_dir
from runwatch.producer.publish.run_watch import RunWatch
from runwatch.producer.publish.spool import HEADER_BYTES, DiskSpool, SpoolLockedError

NO_BROKER = "127.0.0.1:1"


def rec(i: int) -> bytes:
    return f'{{"n":{i:06d}}}'.encode()  # 12 bytes, 20 with the header


RECORD = HEADER_BYTES + len(rec(0))


def drain(spool: DiskSpool, batch: int = 7) -> list[bytes]:
    out = []
    while len(spool):
        first, records = spool.peek(batch)
        out += records
        spool.commit(first + len(records))
    return out


def segments(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.seg"))


def test_records_come_back_oldest_first_across_segments(tmp_path):
    with DiskSpool(tmp_path, max_bytes=100 * RECORD, segment_bytes=5 * RECORD) as spool:
        for i in range(40):
            assert spool.append(rec(i))
        assert len(spool) == 40 and spool.bytes == 40 * RECORD
        assert len(segments(tmp_path)) == 8
        assert spool.peek(3) == (0, [rec(0), rec(1), rec(2)])
        assert spool.peek(3) == (0, [rec(0), rec(1), rec(2)])  # peek does not consume
        assert drain(spool) == [rec(i) for i in range(40)]
        assert len(spool) == 0 and spool.bytes == 0
        assert segments(tmp_path) == []  # an empty spool keeps no segment


def test_commit_deletes_consumed_segments_and_ignores_stale_indexes(tmp_path):
    with DiskSpool(tmp_path, max_bytes=100 * RECORD, segment_bytes=5 * RECORD) as spool:
        for i in range(20):
            spool.append(rec(i))
        first, records = spool.peek(12)
        assert spool.commit(first + 12) == 12
        assert len(segments(tmp_path)) == 2  # records 10..19
        assert spool.commit(first + 5) == 0  # already committed
        assert spool.peek(1) == (12, [rec(12)])


def test_peek_honours_the_byte_limit_but_returns_at_least_one(tmp_path):
    with DiskSpool(tmp_path, max_bytes=1 << 20) as spool:
        spool.append(b"x" * 1000)
        spool.append(b"y")
        assert spool.peek(10, max_bytes=10)[1] == [b"x" * 1000]
        assert spool.peek(10, max_bytes=2000)[1] == [b"x" * 1000, b"y"]


def test_drop_newest_refuses_past_the_bound_and_counts(tmp_path):
    with DiskSpool(tmp_path, max_bytes=10 * RECORD, overflow="drop_newest") as spool:
        accepted = [spool.append(rec(i)) for i in range(15)]
        assert accepted == [True] * 10 + [False] * 5
        assert spool.stats.refused == 5 and spool.stats.evicted == 0
        assert spool.bytes == 10 * RECORD
        assert drain(spool) == [rec(i) for i in range(10)]
        assert spool.append(rec(99))  # room again once drained


def test_drop_oldest_evicts_from_the_head_and_counts(tmp_path):
    with DiskSpool(
        tmp_path, max_bytes=10 * RECORD, overflow="drop_oldest", segment_bytes=3 * RECORD
    ) as spool:
        assert all(spool.append(rec(i)) for i in range(15))
        assert spool.stats.evicted == 5 and spool.stats.refused == 0
        assert spool.bytes == 10 * RECORD
        assert drain(spool) == [rec(i) for i in range(5, 15)]


def test_a_record_larger_than_the_bound_is_refused_under_either_policy(tmp_path):
    for policy in ("drop_newest", "drop_oldest"):
        with DiskSpool(tmp_path / policy, max_bytes=100, overflow=policy) as spool:
            spool.append(rec(1))
            assert not spool.append(b"z" * 200)
            assert spool.stats.refused == 1 and len(spool) == 1


def test_eviction_during_a_replay_keeps_commit_consistent(tmp_path):
    with DiskSpool(tmp_path, max_bytes=10 * RECORD, overflow="drop_oldest") as spool:
        for i in range(10):
            spool.append(rec(i))
        first, records = spool.peek(4)  # "in flight" while two more arrive and evict 0 and 1
        spool.append(rec(10))
        spool.append(rec(11))
        assert spool.commit(first + len(records)) == 2  # only 2 and 3 were still there
        assert spool.peek(100)[1] == [rec(i) for i in range(4, 12)]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError):
        DiskSpool(tmp_path, max_bytes=4)
    with pytest.raises(ValueError):
        DiskSpool(tmp_path, overflow="drop_random")  # type: ignore[arg-type]


def test_a_second_open_of_the_same_directory_is_refused(tmp_path):
    with DiskSpool(tmp_path):
        with pytest.raises(SpoolLockedError):
            DiskSpool(tmp_path)
    DiskSpool(tmp_path).close()  # released on close


def test_restart_resumes_after_the_last_commit(tmp_path):
    spool = DiskSpool(tmp_path, max_bytes=100 * RECORD, segment_bytes=4 * RECORD)
    for i in range(30):
        spool.append(rec(i))
    first, _ = spool.peek(11)
    spool.commit(first + 11)
    spool.close()

    again = DiskSpool(tmp_path, max_bytes=100 * RECORD, segment_bytes=4 * RECORD)
    assert again.stats.recovered == 19 and len(again) == 19 and again.bytes == 19 * RECORD
    again.append(rec(30))  # appends go behind what was recovered
    assert drain(again) == [rec(i) for i in range(11, 31)]
    again.close()
    assert again.remove_if_empty() and not tmp_path.exists()


def test_a_crash_before_the_head_is_persisted_replays_rather_than_loses(tmp_path):
    spool = DiskSpool(tmp_path, max_bytes=100 * RECORD, head_interval_s=3600)
    for i in range(10):
        spool.append(rec(i))
    spool.sync()  # head persisted at record 0
    first, _ = spool.peek(4)
    spool.commit(first + 4)  # not persisted yet (interval)
    spool._close_fds()  # a crash: no close(), no sync
    spool._unlock()

    again = DiskSpool(tmp_path, max_bytes=100 * RECORD)
    assert drain(again) == [rec(i) for i in range(10)]  # 0..3 again: duplicates, never a loss
    again.close()


def test_a_torn_tail_record_is_cut_off_and_the_rest_recovered(tmp_path):
    spool = DiskSpool(tmp_path, max_bytes=100 * RECORD)
    for i in range(5):
        spool.append(rec(i))
    spool.close()
    seg = tmp_path / segments(tmp_path)[-1]
    with open(seg, "ab") as f:
        f.write(b"\x00\x00\x00\x10garb")  # a header promising 16 bytes, then a crash
    again = DiskSpool(tmp_path, max_bytes=100 * RECORD)
    assert again.stats.corrupt == 1 and again.stats.recovered == 5
    assert seg.stat().st_size == 5 * RECORD
    again.append(rec(5))
    assert drain(again) == [rec(i) for i in range(6)]
    again.close()


def test_a_corrupt_record_ends_its_segment(tmp_path):
    spool = DiskSpool(tmp_path, max_bytes=100 * RECORD)
    for i in range(5):
        spool.append(rec(i))
    spool.close()
    seg = tmp_path / segments(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    data[3 * RECORD + HEADER_BYTES] ^= 0xFF  # flip a payload byte of record 3: its crc fails
    seg.write_bytes(bytes(data))
    again = DiskSpool(tmp_path, max_bytes=100 * RECORD)
    assert again.stats.corrupt == 1
    assert drain(again) == [rec(0), rec(1), rec(2)]
    again.close()


# -- RunWatch with the spool ---------------------------------------------------------------


def test_default_spool_dir_is_per_run_and_rank_and_safe(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNWATCH_SPOOL_DIR", str(tmp_path))
    assert default_spool_dir("run-1", 3) == tmp_path / "run-1-r3"
    odd = default_spool_dir("team/run 1", 0)
    assert odd.parent == tmp_path and "/" not in odd.name[:-3]
    assert odd != default_spool_dir("team_run_1", 0)
    monkeypatch.delenv("RUNWATCH_SPOOL_DIR")
    assert default_spool_dir("r", 0) == Path(".runwatch/spool/r-r0").resolve()


def test_without_a_broker_events_are_spooled_not_dropped(tmp_path):
    spool_dir = tmp_path / "spool"
    rw = RunWatch("spool-run", NO_BROKER, spool_dir=spool_dir)
    t = time.monotonic()
    for i in range(500):
        assert rw.step(i, loss=1.0)
    assert time.monotonic() - t < 1.0  # publishing stays a queue put
    t = time.monotonic()
    stats = rw.close(timeout=0.5)
    assert time.monotonic() - t < 0.5 + 3.0
    assert stats.published == 0 and stats.dropped == 0
    assert stats.spooled == stats.spooled_at_close == 502  # run_start, 500 steps, run_end
    assert stats.spool_bytes > 0 and segments(spool_dir)

    # The same run restarted (same run id and rank, same spool) recovers them first.
    again = RunWatch("spool-run", NO_BROKER, spool_dir=spool_dir, rank=0)
    again.step(500, loss=1.0)
    stats2 = again.close(timeout=0.5)
    assert stats2.spool_recovered == 502
    offered = 3  # run_start, one step, run_end
    assert stats2.published + stats2.dropped + stats2.spooled_at_close == offered + stats2.spool_recovered
    assert stats2.spooled_at_close == 505
    with DiskSpool(spool_dir) as spool:
        first, records = spool.peek(1000, max_bytes=1 << 30)
        kinds = [r.split(b'"kind":"')[1].split(b'"')[0] for r in records]
    assert kinds[0] == b"run_start" and kinds[501] == b"run_end" and kinds[502] == b"run_start"


@pytest.mark.parametrize("policy,reason", [("drop_newest", "spool_full"), ("drop_oldest", "spool_evicted")])
def test_the_spool_bound_drops_by_policy_and_the_books_balance(tmp_path, policy, reason):
    rw = RunWatch(
        "bounded", NO_BROKER, spool_dir=tmp_path / policy, spool_max_bytes=20_000, spool_overflow=policy
    )
    for i in range(300):
        rw.step(i, loss=1.0)
    stats = rw.close(timeout=1.0)
    assert stats.spool_dropped > 0
    assert stats.drop_reasons == {reason: stats.spool_dropped}
    assert stats.spool_bytes <= 20_000
    assert stats.published + stats.dropped + stats.spooled_at_close == 302
    with DiskSpool(tmp_path / policy) as spool:
        steps = [r for r in spool.peek(1000)[1] if b'"kind":"step"' in r]
    if policy == "drop_newest":
        assert b'"step":0,' in steps[0]  # the oldest kept
    else:
        assert b'"step":299,' in steps[-1]  # the newest kept


def test_spool_off_drops_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rw = RunWatch("no-spool", NO_BROKER, spool=False)
    for i in range(20):
        rw.step(i, loss=1.0)
    stats = rw.close(timeout=0.5)
    assert stats.published == 0 and stats.spooled == 0 and stats.dropped == 22
    assert not (tmp_path / ".runwatch").exists()


def test_an_unusable_spool_directory_falls_back_to_dropping(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rw = RunWatch("bad-spool", NO_BROKER, spool_dir=blocker / "spool")
    for i in range(10):
        rw.step(i, loss=1.0)
    stats = rw.close(timeout=0.5)
    assert stats.published == 0 and stats.spooled == 0
    assert stats.dropped == 12 and set(stats.drop_reasons) <= {"send_failed", "undelivered_at_close"}


def test_nothing_touches_the_disk_while_the_broker_is_only_slow(tmp_path):
    # Construction and publishing never create the spool; only a failed send does.
    rw = RunWatch("lazy", NO_BROKER, spool_dir=tmp_path / "lazy", max_block_ms=1000)
    rw.step(1, loss=1.0)
    time.sleep(0.2)
    assert not os.path.exists(tmp_path / "lazy")
    rw.close(timeout=0.1)
