"""One run split by rank group over two workers (issue 36), as users start everything: the embedded
broker, two ``runwatch worker`` of one group, and ``runwatch simulate`` from an empty folder. 16 ranks in
groups of 4: both workers hold part of the run; its joined steps come whole from the groups' partials; a
NaN on rank 7 gives one rollback to a checkpoint; a rank 1.5x slower is named a straggler."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import JoinedStep, decode_action, decode_anomaly
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from tests.conftest import eventually, read_topic, read_topic_for

pytestmark = pytest.mark.integration

RANKS, GROUP_SIZE, STEPS = 16, 4, 70


def test_a_run_split_by_rank_group_over_two_workers_is_judged_as_one(tmp_path, action_keys):
    run_id = f"split-{uuid.uuid4().hex[:8]}"  # (its four groups fill the four partitions, whatever its id)
    group = "runwatch-split-test"
    folder = tmp_path / "empty"
    folder.mkdir()
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        workers = [
            WorkerProcess(broker.bootstrap, action_keys.signing, tmp_path / f"worker{i}.log", group=group)
            for i in range(2)
        ]
        try:
            for worker in workers:
                worker.wait_ready(120)

            def telemetry_held(worker: WorkerProcess) -> int:
                return sum(p.startswith(f"{topics.TELEMETRY}:") for p in worker.health()[1]["partitions"])

            eventually(lambda: [telemetry_held(w) for w in workers] == [2, 2], 90, "each worker to hold 2")
            cmd = [sys.executable, "-m", "runwatch.cli", "simulate", "--bootstrap", broker.bootstrap]
            cmd += ["--run-id", run_id, "--ranks", str(RANKS), "--group-size", str(GROUP_SIZE)]
            cmd += ["--steps", str(STEPS), "--step-time", "0.15", "--heartbeat-s", "1"]
            cmd += ["--fault", "nan:7:50", "--fault", "slow:13:1.5", "--checkpoint-every", "10"]
            done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["group_size"] == GROUP_SIZE

            def rollbacks(records) -> list:
                ours = [decode_action(r.value) for r in records if r.key == run_id.encode()]
                return [a for a in ours if a.kind == "rollback"]

            read_topic(broker.bootstrap, topics.ACTIONS, lambda rs: bool(rollbacks(rs)), 90)

            def joined(records) -> list[JoinedStep]:
                return [JoinedStep.model_validate_json(r.value) for r in records if r.key == run_id.encode()]

            steps = joined(read_topic(broker.bootstrap, topics.JOINED, lambda rs: len(joined(rs)) >= 60, 90))
            healthy = [s for s in steps if s.step < 50]
            assert healthy and all(s.world_size == RANKS and s.reported_count == RANKS for s in healthy)
            assert all(s.complete and s.missing_count == 0 for s in healthy)
            assert len({s.step for s in steps}) == len(steps)  # each step joined once, by one worker

            anomalies = [
                decode_anomaly(r.value)
                for r in read_topic_for(broker.bootstrap, topics.ANOMALIES, 5)
                if r.key == run_id.encode()
            ]
            assert {(a.rank, a.step) for a in anomalies if a.detector == "non_finite"} >= {(7, 50)}
            assert {a.rank for a in anomalies if a.detector == "straggler"} == {13}
            # every finding is about the run, issued by the worker of its own key; none before the faults
            early = [a for a in anomalies if a.detector not in ("straggler",) and (a.step or 0) < 50]
            assert early == []
            # a few seconds more: one fault, one rollback, whichever groups saw it
            [rollback] = rollbacks(read_topic_for(broker.bootstrap, topics.ACTIONS, 5))
            assert rollback.target_checkpoint is not None and rollback.target_checkpoint.step <= 40
            # both workers read part of the run
            assert all(w.health()[1]["events_submitted"] > 100 for w in workers)
        finally:
            for worker in workers:
                worker.stop()


def test_a_split_runs_rank_publishes_to_its_groups_partition(broker):
    """RunWatch, as a rank of a split run: its events say the run's shape and land on its group's partition
    (the worker refuses a record elsewhere)."""
    from kafka.partitioner.default import murmur2

    from runwatch.contract.schema import decode_event
    from runwatch.contract.topics import key_partition
    from runwatch.producer import RunWatch

    def murmur_partition(key: bytes) -> int:
        return (murmur2(key) & 0x7FFFFFFF) % topics.DEFAULT_PARTITIONS

    # a run whose group key murmur2 would put elsewhere: only the explicit placement lands it right
    run_id = next(
        r
        for r in (f"split-rw-{uuid.uuid4().hex[:8]}" for _ in range(100))
        if murmur_partition(f"{r}#1".encode()) != key_partition(f"{r}#1".encode(), topics.DEFAULT_PARTITIONS)
    )
    rw = RunWatch(
        run_id, broker.bootstrap, rank=5, world_size=8, group_size=4, spool=False, collect_metadata=False
    )
    try:
        for step in range(3):
            rw.step(step, loss=1.0)
    finally:
        rw.close(timeout=10)
    assert rw.stats.published == 3, rw.stats

    def ours(records) -> list:
        return [r for r in records if r.key == f"{run_id}#1".encode()]

    records = ours(read_topic(broker.bootstrap, topics.TELEMETRY, lambda rs: len(ours(rs)) >= 3, 30))
    assert {r.partition for r in records} == {
        key_partition(f"{run_id}#1".encode(), topics.DEFAULT_PARTITIONS)
    }
    events = [decode_event(r.value, key=r.key) for r in records]
    assert {(e.rank, e.group_size, e.world_size) for e in events} == {(5, 4, 8)}
