"""A hang's evidence bundle (issue 38): 4-rank gloo DDP on CPU, rank 2 sleeps right before its all_reduce at
step 50. Every rank's heartbeat thread sends its Python stacks once its step has stood still for
``stacks_after_s`` (5 s), with PyTorch's flight recorder dump (on here: TORCH_FR_BUFFER_SIZE); the worker,
on the default detector config, names rank 2 as hung within 15 s of the hang, with the four stacks attached:
rank 2's at the sleeping line of dist_train.py, ranks 0, 1 and 3 in all_reduce. The evidence events and the
finding are stored in ClickHouse, and the report shows the stacks as text."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import StackEvidenceEvent, decode_event
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from tests.conftest import read_topic, worker_with_config
from tests.worker.test_multi_rank import SCRIPT, Run

pytestmark = pytest.mark.integration

WORLD = 4
HUNG_RANK, HANG_STEP = 2, 50
# The worker's config: the defaults (docs/configuration.md), so the 15 s hold with what users run: hung_rank
# and stall allow 3 x the median step + 10 s in the train phase; the producer sends its stacks after 5 s.
CONFIG: dict = {}
SLEEP_LINE = next(
    i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "HANG-BEFORE-ALLREDUCE" in line
)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with EmbeddedBroker(log_path=tmp_path_factory.mktemp("hang-broker") / "broker.log") as b:
        ensure_topics(b.bootstrap)
        yield b


@pytest.fixture(scope="module")
def hang_worker(broker, action_keys, tmp_path_factory):
    with worker_with_config(
        broker, action_keys, tmp_path_factory.mktemp("hang-worker"), CONFIG, "runwatch-detect-hang"
    ) as worker:
        yield worker


def _evidence(bootstrap: str, run_id: str, ranks: int, timeout: float) -> dict[int, StackEvidenceEvent]:
    found: dict[int, StackEvidenceEvent] = {}

    def enough(records: list) -> bool:
        for r in records:
            if b'"evidence"' in r.value:
                event = decode_event(r.value)
                if isinstance(event, StackEvidenceEvent) and event.run_id == run_id:
                    found[event.rank] = event
        return len(found) >= ranks

    read_topic(bootstrap, topics.TELEMETRY, enough, timeout)
    return found


def test_a_rank_hung_before_its_all_reduce_is_named_with_every_ranks_stack(
    broker, action_keys, hang_worker, tmp_path, chdb_dsn
):
    run = Run(
        broker,
        action_keys.public_text,
        tmp_path,
        f"hang_before_allreduce:{HUNG_RANK}:{HANG_STEP}",
        steps=400,
        world=WORLD,
        env={"TORCH_FR_BUFFER_SIZE": "2000"},
    )
    try:
        # the hang's start: rank 2 writes its result file just before it sleeps
        result = Path(tmp_path) / f"result-{HUNG_RANK}.json"
        deadline = time.monotonic() + 180
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert result.exists(), run.logs()
        hang_at = datetime.now(UTC)
        anomalies = run.anomalies(lambda got: any(a.detector == "hung_rank" for a in got), timeout=60)
        (hung,) = [a for a in anomalies if a.detector == "hung_rank"]
        assert hung.detected_at is not None
        latency = (hung.detected_at - hang_at).total_seconds()
        print(f"hang to hung_rank: {latency:.2f} s ({hung.message})")
        assert hung.rank == HUNG_RANK and hung.step == HANG_STEP - 1, hung.message
        assert latency <= 15.0, (latency, hung.message)

        stacks = hung.evidence["stacks"]
        assert set(stacks) == {str(r) for r in range(WORLD)}, hung.evidence
        culprit = stacks[str(HUNG_RANK)]
        assert culprit["waits_in"] == f"dist_train.py:{SLEEP_LINE} in main", culprit
        assert "time.sleep(600)" in culprit["code"]
        assert culprit["frames"][-1].endswith(f"dist_train.py:{SLEEP_LINE} in main")
        for peer in set(range(WORLD)) - {HUNG_RANK}:
            stack = stacks[str(peer)]
            assert stack["collective"] == "all_reduce", stack
            assert any(" in all_reduce" in f for f in stack["frames"]), stack
        assert f"rank {HUNG_RANK} waits in dist_train.py:{SLEEP_LINE} in main" in hung.message
        assert "ranks 0, 1, 3 wait in all_reduce (torch/distributed/distributed_c10d.py:" in hung.message
        # the flight recorder (gloo keeps one in torch 2.7 and later) is attached: a collective in flight
        assert "attached" in culprit["flight_recorder_status"], culprit
        assert "in flight: gloo:all_reduce" in stacks["0"]["flight_recorder"], stacks["0"]

        # the action the policy issued for it names the frame too
        actions = run.actions(lambda got: any(hung.anomaly_id in a.anomaly_ids for a in got), timeout=30)
        (alert,) = [a for a in actions if hung.anomaly_id in a.anomaly_ids]
        assert f"dist_train.py:{SLEEP_LINE} in main" in alert.reason
        assert alert.params["waits_in"][str(HUNG_RANK)] == culprit["waits_in"]

        evidence = _evidence(broker.bootstrap, run.run_id, WORLD, timeout=30)
        assert set(evidence) == set(range(WORLD))
        dump = evidence[0].flight_recorder
        assert dump is not None and "gloo:all_reduce" in dump
        assert all(e.step == HANG_STEP - 1 and not e.truncated for e in evidence.values())
        _stored_and_reported(chdb_dsn, run.run_id, list(evidence.values()), hung)
    finally:
        run.kill()


def _stored_and_reported(chdb_dsn: str, run_id: str, events: list[StackEvidenceEvent], hung) -> None:
    from runwatch.sinks import ClickHouseSink
    from runwatch.sinks.report.html import stacks_section

    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        sink.writer.write_events(events, [e.to_json() for e in events])
        sink.writer.write_anomalies([hung])
        rows = sink.query(
            "SELECT rank, payload FROM {db}.telemetry WHERE run_id = %(r)s AND kind = 'evidence' "
            "ORDER BY rank",
            {"r": run_id},
        )
        assert [r for r, _ in rows] == list(range(WORLD))
        assert all("all_reduce" in payload for _, payload in rows)
        (stored,) = [a for a in sink.report.anomalies(run_id) if a["detector"] == "hung_rank"]
        assert set(stored["evidence"]["stacks"]) == {str(r) for r in range(WORLD)}
    finally:
        sink.close()
    from runwatch.sinks.report.data import ReportData

    html = stacks_section(
        ReportData(
            run_id=run_id,
            info={"events": 0, "first_ts": None, "last_ts": None, "ranks": WORLD, "last_step": 0},
            run_start={},
            run_end=None,
            steps=[],
            rank_step_times=[],
            modules=[],
            heatmap=[],
            heatmap_bucket_steps=1,
            evals=[],
            anomalies=[stored],
            actions=[],
        )
    )
    assert "time.sleep(600)" in html and "in all_reduce" in html
