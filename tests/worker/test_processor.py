"""The worker's per-message logic, without Faust or a broker. A bad message must become a dead letter
with a reason (and must not stop the stream), a run id outside the documented characters too; a NaN run
must yield a signed rollback the trainer will accept, expiring ``action_ttl_s`` after issue; run_end must
free the run's state. The timer: test_processor_ticks.py; record times: test_processor_record_times.py;
runs that end, start again or are let go: test_processor_run_lifecycle.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import timedelta

import pytest

from runwatch.contract.schema import CheckpointEvent, CheckpointRef, RunEndEvent, StepEvent
from runwatch.contract.signing import ActionSigningKey, verify_action
from runwatch.contract.topics import TELEMETRY
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import PUBLIC
from tests.support.processor_events import SECRET, T0, WALL, step_json

# The fields every telemetry event must carry, minus run_id and kind (which tests vary).
HEAD = b'{"schema_version":1,"event_id":"e","rank":0,"ts":"2024-05-01T12:00:00Z",'


# -- dead letters ----------------------------------------------------------------------------------


@pytest.mark.integration  # starts a process
def test_importing_the_processor_needs_no_broker_or_faust():
    code = (
        "import sys, runwatch.worker.processor as p; "
        "print(sorted(m for m in ('faust', 'kafka', 'aiokafka', 'clickhouse_connect') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "raw, reason_start, reason_has",
    [
        (b"\x00\x01 definitely not json", "not JSON", ""),
        (HEAD + b'"kind":"step","run_id":"run-1"}', "schema:", "step"),
        (HEAD + b'"kind":"step","run_id":"run-1","step":"abc"}', "schema:", "step"),
        (HEAD + b'"kind":"step","step":3}', "schema:", "run_id"),
        (HEAD + b'"kind":"nope","run_id":"run-1"}', "schema:", "nope"),
        (b"[1,2,3]", "schema:", "object"),
    ],
)
def test_malformed_message_is_dead_lettered_and_the_stream_goes_on(proc, raw, reason_start, reason_has):
    result = proc.process(raw, key=b"run-1", partition=2, offset=41)
    dl = result.deadletter
    assert dl is not None
    assert dl.reason.startswith(reason_start) and reason_has in dl.reason
    assert dl.source_topic == TELEMETRY
    assert (dl.partition, dl.offset, dl.key) == (2, 41, "run-1")
    assert dl.raw == raw.decode(errors="replace")
    assert result.anomalies == [] and result.actions == []
    assert proc.counters.deadlettered == 1
    assert proc.counters.processed == 0
    assert proc.monitors == {}

    ok = proc.process(step_json(0), key=b"run-1", partition=2, offset=42)
    assert ok.deadletter is None
    assert proc.counters.processed == 1
    assert proc.counters.deadlettered == 1
    assert "run-1" in proc.monitors


def test_key_not_matching_run_id_is_dead_lettered(proc):
    result = proc.process(step_json(0, run_id="run-1"), key=b"run-2", partition=0, offset=7)
    assert result.deadletter is not None
    assert "run-2" in result.deadletter.reason and "run-1" in result.deadletter.reason
    assert proc.counters.deadlettered == 1
    assert "run-1" not in proc.monitors  # the wrong partition must not grow state for the run


def test_deadletter_is_itself_valid_wire_json(proc):
    dl = proc.process(b"\xff\xfe not utf8", key=None).deadletter
    data = json.loads(dl.to_json())
    assert data["reason"].startswith("not JSON")
    assert data["source_topic"] == TELEMETRY
    assert "key" not in data


def test_deadletters_are_counted(proc):
    for i in range(5):
        proc.process(b"garbage", offset=i)
    proc.process(step_json(0), key=b"run-1")
    proc.process(b"{}", offset=6)
    assert proc.counters.deadlettered == 6
    assert proc.counters.processed == 1


# -- actions and run state -------------------------------------------------------------------------


def _nan_run(proc: TelemetryProcessor):
    results = []
    for s in range(12):
        if s == 1:
            ckpt = CheckpointEvent(run_id="run-1", step=1, uri="/ckpt/1.pt", ts=T0 + timedelta(seconds=s))
            results.append(proc.process(ckpt.to_json(), key=b"run-1"))
        results.append(proc.process(step_json(s, loss=math.nan if s >= 8 else 1.0), key=b"run-1"))
    return results


def test_nan_run_yields_a_signed_rollback(proc):
    results = _nan_run(proc)
    assert all(r.deadletter is None for r in results)
    actions = [a for r in results for a in r.actions]
    anomalies = [a for r in results for a in r.anomalies]
    assert [(a.step, a.severity, a.detector) for a in anomalies] == [
        (8, "warning", "non_finite"),
        (10, "critical", "non_finite"),
    ]
    assert [a.kind for a in actions] == ["alert", "rollback"]
    rollback = actions[1]
    assert rollback.run_id == "run-1"
    assert rollback.onset_step == 8
    assert rollback.target_checkpoint == CheckpointRef(step=1, uri="/ckpt/1.pt")  # confirmed at step 7
    assert rollback.anomaly_ids == [anomalies[1].anomaly_id]

    assert verify_action(rollback, PUBLIC)
    assert not verify_action(rollback, ActionSigningKey.generate().public)
    assert rollback.issued_at == WALL
    assert rollback.expires_at - rollback.issued_at == timedelta(seconds=proc.config.policy.action_ttl_s)
    assert not rollback.is_expired(WALL)

    assert proc.counters.anomalies == 2
    assert proc.counters.actions == {"alert": 1, "rollback": 1}
    assert proc.counters.processed == 13


def test_actions_use_the_configured_ttl():
    cfg = RunwatchConfig.model_validate({"policy": {"action_ttl_s": 7.5}})
    proc = TelemetryProcessor(cfg, SECRET, clock=lambda: WALL)
    actions = [a for r in _nan_run(proc) for a in r.actions]
    assert actions and all(a.expires_at - a.issued_at == timedelta(seconds=7.5) for a in actions)


def test_reprocessing_the_same_bytes_gives_the_same_ids():
    raws = [step_json(s, loss=math.nan if s >= 3 else 1.0) for s in range(8)]

    def run():
        p = TelemetryProcessor(RunwatchConfig(), SECRET, clock=lambda: WALL)
        results = [p.process(r, key=b"run-1") for r in raws]
        return (
            [a.anomaly_id for r in results for a in r.anomalies],
            [a.action_id for r in results for a in r.actions],
        )

    assert run() == run()
    assert len(run()[1]) == 2


def test_run_end_removes_the_runs_monitor(proc):
    proc.process(step_json(0, run_id="run-1"), key=b"run-1")
    proc.process(step_json(0, run_id="run-2"), key=b"run-2")
    assert set(proc.monitors) == {"run-1", "run-2"}
    end = proc.process(RunEndEvent(run_id="run-1", status="completed", ts=T0).to_json(), key=b"run-1")
    assert end.deadletter is None
    assert set(proc.monitors) == {"run-2"}


def test_runs_are_independent(proc):
    for s in range(6):
        proc.process(step_json(s, loss=math.nan, run_id="bad"), key=b"bad")
        out = proc.process(step_json(s, loss=1.0, run_id="good"), key=b"good")
        assert out.anomalies == [] and out.actions == []
    assert not proc.monitors["good"].policy.stopped
    assert proc.monitors["bad"].policy.stopped  # no checkpoint to restore: stopped


def test_multi_rank_steps_come_out_joined(proc):
    from runwatch.contract.schema import RunStartEvent

    proc.process(RunStartEvent(run_id="dist", world_size=2, ts=T0).to_json(), key=b"dist")
    first = proc.process(
        StepEvent(run_id="dist", rank=0, step=0, grad_norm=3.0, grad_sharded=True, ts=T0).to_json(),
        key=b"dist",
    )
    assert first.joined == []
    second = proc.process(
        StepEvent(run_id="dist", rank=1, step=0, grad_norm=4.0, grad_sharded=True, ts=T0).to_json(),
        key=b"dist",
    )
    (joined,) = second.joined
    assert joined.grad_norm == pytest.approx(5.0) and joined.ranks_reported == [0, 1]


def test_actions_carry_the_runs_job_id_for_remediation(proc):
    from runwatch.contract.schema import RunStartEvent

    proc.process(
        RunStartEvent(
            run_id="job-run", job_id="81234", host="node7", tags={"pod": "trainer-0"}, ts=T0
        ).to_json(),
        key=b"job-run",
    )
    actions = []
    for s in range(5):
        actions += proc.process(step_json(s, loss=math.nan, run_id="job-run"), key=b"job-run").actions
    assert actions
    assert all(
        a.params["job_id"] == "81234" and a.params["host"] == "node7" and a.params["pod"] == "trainer-0"
        for a in actions
    )
    assert all(verify_action(a, ActionSigningKey.from_seed(proc._secret).public) for a in actions)


# -- run ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run_id", ["a\nb", "a\x00b", "has space", "tab\there", "ü-run", "a<b>", "x" * 257, ""]
)
def test_a_run_id_outside_the_documented_characters_is_deadlettered(proc, run_id):
    raw = json.dumps(
        {
            "schema_version": 1,
            "event_id": "e",
            "run_id": run_id,
            "rank": 0,
            "ts": T0.isoformat(),
            "kind": "step",
            "step": 1,
        }
    ).encode()
    result = proc.process(raw, key=run_id.encode() or None)
    assert result.deadletter is not None, run_id
    assert "run_id" in result.deadletter.reason
    assert proc.monitors == {}


@pytest.mark.parametrize("run_id", ["run-42", "llama/7b:pretrain@node+1=ok", "a.b_c-d", "x" * 256])
def test_run_ids_of_the_documented_characters_are_accepted(proc, run_id):
    result = proc.process(step_json(1, run_id=run_id), key=run_id.encode())
    assert result.deadletter is None and run_id in proc.monitors
