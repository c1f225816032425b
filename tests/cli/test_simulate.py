"""``runwatch simulate`` as a user runs it: from an empty folder, against the session's broker and worker. A
NaN on one of 16 simulated ranks is found on that rank, and the summary says what was sent."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import decode_anomaly
from tests.conftest import read_topic

pytestmark = pytest.mark.integration


def test_simulate_plays_a_run_whose_nan_is_found_on_its_rank(broker, worker, tmp_path):
    run_id = f"sim-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "empty"
    folder.mkdir()
    cmd = [sys.executable, "-m", "runwatch.cli", "simulate", "--bootstrap", broker.bootstrap]
    cmd += ["--run-id", run_id, "--ranks", "16", "--steps", "30", "--step-time", "0.1", "--fault", "nan:5:12"]
    done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["events"]["step"] == 16 * 30 and summary["events"]["run_start"] == 1
    assert f"simulating run {run_id}: 16 ranks" in done.stderr

    def found(records) -> list:
        return [
            a
            for a in (decode_anomaly(r.value) for r in records if r.key == run_id.encode())
            if a.detector == "non_finite"
        ]

    records = read_topic(broker.bootstrap, topics.ANOMALIES, lambda rs: bool(found(rs)), 60)
    assert {(a.rank, a.step) for a in found(records)} >= {(5, 12)}


def test_a_bad_fault_is_refused_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "runwatch.cli", "simulate", "--bootstrap", "127.0.0.1:1", "--ranks", "4"]
    done = subprocess.run(
        [*cmd, "--fault", "hang:7:3"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "rank 7 is not one of the run's ranks (0-3)" in done.stderr
