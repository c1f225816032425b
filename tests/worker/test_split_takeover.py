"""A split run survives a worker killed with SIGKILL (issue 36): 16 simulated ranks in groups of 4 over four
workers (a partition each); one worker is killed mid-run, its group (and perhaps the run's own key) moves to
another, which restores it from its snapshot; the NaN on rank 7 after the kill gets one rollback, no action
is issued twice, and every step of the run is joined whole."""

from __future__ import annotations

import os
import signal
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

RANKS, GROUP_SIZE, STEPS, NAN_AT, WORKERS = 16, 4, 90, 60, 4


def _telemetry_held(worker: WorkerProcess) -> int:
    return sum(p.startswith(f"{topics.TELEMETRY}:") for p in worker.health()[1]["partitions"])


def test_a_split_run_keeps_its_state_when_a_worker_is_killed(tmp_path, action_keys):
    run_id = f"split-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "empty"
    folder.mkdir()
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        workers = [
            WorkerProcess(broker.bootstrap, action_keys.signing, tmp_path / f"w{i}.log", group="split-kill")
            for i in range(WORKERS)
        ]
        sim = None
        try:
            for worker in workers:
                worker.wait_ready(120)
            eventually(
                lambda: [_telemetry_held(w) for w in workers] == [1] * WORKERS, 120, "a partition each"
            )
            cmd = [sys.executable, "-m", "runwatch.cli", "simulate", "--bootstrap", broker.bootstrap]
            cmd += ["--run-id", run_id, "--ranks", str(RANKS), "--group-size", str(GROUP_SIZE)]
            cmd += ["--steps", str(STEPS), "--step-time", "0.25", "--heartbeat-s", "1"]
            cmd += ["--fault", f"nan:7:{NAN_AT}", "--checkpoint-every", "10"]
            sim = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

            def joined(records) -> list[JoinedStep]:
                return [JoinedStep.model_validate_json(r.value) for r in records if r.key == run_id.encode()]

            # past step 30 (checkpoints at 10, 20 and 30 confirmed or pending): a crash, no goodbye
            read_topic(broker.bootstrap, topics.JOINED, lambda rs: any(s.step >= 30 for s in joined(rs)), 90)
            killed, survivors = workers[0], workers[1:]
            os.kill(killed.process.pid, signal.SIGKILL)
            killed.process.wait(10)
            eventually(
                lambda: sum(_telemetry_held(w) for w in survivors) == 4,
                90,
                "the others to take its partition",
            )
            # the killed worker's group (one a partition: groups fill the partitions in turn) comes back from
            # its snapshot, not re-warmed from nothing
            eventually(
                lambda: sum(w.health()[1]["counters"]["restored_runs"] for w in survivors) >= 1,
                60,
                "its group to be restored",
            )
            out, err = sim.communicate(timeout=180)
            assert sim.returncode == 0, err

            def rollbacks(records) -> list:
                return [a for a in _actions(records, run_id) if a.kind == "rollback"]

            read_topic(broker.bootstrap, topics.ACTIONS, lambda rs: bool(rollbacks(rs)), 120)
            steps = joined(
                read_topic(broker.bootstrap, topics.JOINED, lambda rs: _through(joined(rs), NAN_AT), 120)
            )
            # (a repeated answer would come within the next ticks)
            actions = _actions(read_topic_for(broker.bootstrap, topics.ACTIONS, 8), run_id)
            anomalies = [
                decode_anomaly(r.value)
                for r in read_topic_for(broker.bootstrap, topics.ANOMALIES, 3)
                if r.key == run_id.encode()
            ]
        finally:
            if sim is not None and sim.poll() is None:
                sim.kill()
            for worker in workers:
                worker.stop()

    # one fault, one rollback, to a checkpoint from before it; nothing issued twice
    assert [a.kind for a in actions if a.kind == "rollback"] == ["rollback"], [a.reason for a in actions]
    ids = [a.action_id for a in actions]
    assert len(ids) == len(set(ids))
    target = actions[[a.kind for a in actions].index("rollback")].target_checkpoint
    assert target is not None and target.step < NAN_AT
    assert {(a.rank, a.step) for a in anomalies if a.detector == "non_finite"} >= {(7, NAN_AT)}
    # every step up to the fault joined from all 16 ranks (a step the successor joined again is the same)
    whole = {s.step for s in steps if s.step < NAN_AT and s.reported_count == RANKS and s.world_size == RANKS}
    assert whole == set(range(NAN_AT)), sorted(set(range(NAN_AT)) - whole)


def _actions(records: list, run_id: str) -> list:
    return [decode_action(r.value) for r in records if r.key == run_id.encode()]


def _through(steps: list[JoinedStep], step: int) -> bool:
    return {s.step for s in steps} >= set(range(step))
