"""Issue 35, item 9, with real parts: a trainer whose clock is 7 minutes fast (fast_clock_train.py: every
wall-clock time runwatch reads in the training process, so its event times, its Kafka record times and its
listener's judgement of actions, are on that clock). The
session's worker watches it, says so once (a ``clock_skew`` warning, alerted), finds its NaN and rolls it
back; the trainer's listener, on its fast clock, applies both actions (before: every event dead-lettered,
no finding, and every action the trainer received would have been expired)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import CLOCK_AHEAD_PARAM, decode_action, decode_anomaly
from tests.conftest import read_topic

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parents[1] / "support" / "fast_clock_train.py"
AHEAD_S = 420


def test_a_trainer_minutes_fast_is_watched_told_and_rolled_back(broker, action_keys, worker, tmp_path):
    run_id = f"fast-clock-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        topics.PUBLIC_KEYS_ENV: action_keys.public_text,
        "RUNWATCH_SPOOL_DIR": str(tmp_path / "spool"),
        "FAST_CLOCK_AHEAD_S": str(AHEAD_S),
    }
    cmd = [sys.executable, str(SCRIPT), "--bootstrap", broker.bootstrap]
    cmd += ["--run-id", run_id, "--out", str(tmp_path), "--steps", "300", "--fault", "nan:70"]
    with open(tmp_path / "train.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        code = proc.wait(240)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError((tmp_path / "train.log").read_text()[-3000:]) from None
    log_text = (tmp_path / "train.log").read_text()
    assert code == 0, log_text[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())

    applied = [(a["kind"], a["outcome"]) for a in result["applied"]]
    assert ("rollback", "applied") in applied, result
    assert result["ignored"].get("expired", 0) == 0 and result["ignored"].get("stale", 0) == 0, result

    def of_run(records, decode):
        return [
            d for d in (decode(r.value) for r in records if r.key == run_id.encode()) if d.run_id == run_id
        ]

    anomalies = of_run(
        read_topic(
            broker.bootstrap,
            topics.ANOMALIES,
            lambda rs: any(a.detector == "clock_skew" for a in of_run(rs, decode_anomaly)),
            60,
        ),
        decode_anomaly,
    )
    skew = [a for a in anomalies if a.detector == "clock_skew"]
    assert len(skew) == 1 and abs(skew[0].evidence["ahead_s"] - AHEAD_S) < 30, skew
    assert any(a.detector == "non_finite" for a in anomalies)
    actions = of_run(read_topic(broker.bootstrap, topics.ACTIONS, lambda rs: True, 10), decode_action)
    assert all(abs(a.params[CLOCK_AHEAD_PARAM]["0"] - AHEAD_S) < 30 for a in actions), actions
