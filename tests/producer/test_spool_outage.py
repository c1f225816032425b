"""Broker outages: the trainer spools what the broker does not take and replays it when the
broker is back. A real demo run (embedded Tansu behind the outage proxy, a real Faust worker,
the sink, real torch) with every client cut off for the middle third ends with every event in
ClickHouse exactly once; and a restarted run replays what an earlier process left on disk."""

from __future__ import annotations

import uuid
from pathlib import Path

import orjson
import pytest

from runwatch.contract import topics
from runwatch.demo.run import DemoOptions, run_demo
from runwatch.local.broker import free_port
from runwatch.producer import RunWatch, StepEvent
from runwatch.producer.publish.spool import DiskSpool
from runwatch.sinks import ClickHouseSink
from tests.conftest import read_topic

pytestmark = pytest.mark.integration

STEPS = 300
STEP_INTERVAL_S = 0.05  # a minimum: the middle third lasts about 5 s, past the 3 s delivery timeout


def test_middle_third_outage_ends_with_every_event_stored_exactly_once(tmp_path, monkeypatch, chdb_dsn):
    monkeypatch.chdir(tmp_path)  # the demo's state (spool, checkpoints, logs) goes under ./.runwatch
    monkeypatch.delenv(topics.BOOTSTRAP_ENV, raising=False)
    report = run_demo(
        DemoOptions(
            scenario="healthy",
            steps=STEPS,
            dsn=chdb_dsn,
            step_interval_s=STEP_INTERVAL_S,
            broker_outage=(1 / 3, 2 / 3),
        )
    )
    outage = report["broker_outage"]
    assert (outage["from_step"], outage["to_step"]) == (100, 200)
    assert outage["down_s"] > 3.0  # longer than RunWatch's delivery timeout
    assert report["steps_completed"] == STEPS

    spool = report["spool"]
    assert spool["spooled"] > 0, "the outage outlasted the delivery timeout, so events must have been spooled"
    assert spool["replayed"] == spool["spooled"]
    assert spool["dropped"] == 0 and spool["at_close"] == 0
    # Nothing dropped and nothing left in the spool: every event offered was published (the books
    # balance exactly; heartbeats are timed, so the total is read from the report).
    assert report["events_dropped"] == 0
    offered = report["events_published"]
    assert offered > STEPS + 2
    assert not Path(spool["path"]).exists()  # emptied, then removed

    sink = ClickHouseSink(chdb_dsn)
    try:
        run = {"run": report["run_id"]}
        ((final_rows, final_ids),) = sink.query(
            "SELECT count(), uniqExact(event_id) FROM {db}.telemetry FINAL WHERE run_id = %(run)s", run
        )
        assert final_rows == final_ids == offered == report["clickhouse"]["telemetry_rows"]
        steps = sink.query(
            "SELECT step, count() FROM {db}.telemetry FINAL "
            "WHERE run_id = %(run)s AND kind = 'step' GROUP BY step ORDER BY step",
            run,
        )
        assert [s for s, _ in steps] == list(range(1, STEPS + 1))
        assert all(n == 1 for _, n in steps)
        kinds = dict(
            sink.query(
                "SELECT kind, count() FROM {db}.telemetry FINAL WHERE run_id = %(run)s GROUP BY kind", run
            )
        )
        assert kinds["run_start"] == kinds["run_end"] == 1
        assert kinds["checkpoint"] == len(range(0, STEPS + 1, 25))
        ((raw_rows, raw_ids),) = sink.query(
            "SELECT count(), uniqExact(event_id) FROM {db}.telemetry WHERE run_id = %(run)s", run
        )
        assert raw_ids == offered
        # Duplicates before merge come from re-sent or re-delivered batches; FINAL folds them away.
        print(
            f"outage {outage}, spool {spool}, raw duplicates {raw_rows - raw_ids}, "
            f"wall {report['wall_time_s']}s"
        )
    finally:
        sink.close()


def test_a_restarted_run_replays_what_an_earlier_process_spooled(broker, tmp_path):
    run_id = f"restart-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"

    first = RunWatch(run_id, f"127.0.0.1:{free_port()}", spool_dir=spool_dir)  # nothing listens there
    for step in range(1, 51):
        first.step(step, loss=1.0)
    stats = first.close(timeout=0.5, status="interrupted")
    assert stats.spooled_at_close == 52 and stats.published == 0 and stats.dropped == 0

    second = RunWatch(run_id, broker.bootstrap, spool_dir=spool_dir)  # the job restarts, the broker is up
    for step in range(51, 81):
        second.step(step, loss=1.0)
    stats = second.close(timeout=20)
    assert stats.spool_recovered == 52
    assert stats.published == 52 + 32 and stats.dropped == 0 and stats.spooled_at_close == 0
    assert not spool_dir.exists()

    def mine(records: list) -> list[dict]:
        return [orjson.loads(r.value) for r in records if r.key == run_id.encode()]

    events = mine(read_topic(broker.bootstrap, topics.TELEMETRY, lambda rs: len(mine(rs)) >= 84))
    assert len({e["event_id"] for e in events}) == len(events) == 84  # each once
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(1, 81))  # the spooled ones first, in order, then the new ones
    assert [e["kind"] for e in events].count("run_start") == 2


def test_a_record_the_broker_can_never_take_is_dropped_not_replayed_forever(broker, tmp_path):
    run_id = f"poison-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"
    before, after = (StepEvent(run_id=run_id, rank=1, step=s, loss=1.0) for s in (1, 2))
    with DiskSpool(spool_dir) as spool:  # as an earlier process would have left it
        spool.append(before.to_json())
        spool.append(b"x" * (3 << 19))  # 1.5 MiB: over the client's max_request_size
        spool.append(after.to_json())

    rw = RunWatch(run_id, broker.bootstrap, rank=1, spool_dir=spool_dir)
    stats = rw.close(timeout=20)
    assert stats.spool_recovered == 3
    assert stats.published == stats.replayed == 2
    assert stats.drop_reasons == {"rejected": 1} and stats.spooled_at_close == 0

    def mine(records: list) -> list[bytes]:
        return [r.value for r in records if r.key == run_id.encode()]

    values = mine(read_topic(broker.bootstrap, topics.TELEMETRY, lambda rs: len(mine(rs)) >= 2))
    assert [orjson.loads(v)["event_id"] for v in values] == [before.event_id, after.event_id]
