"""The worker's detector process: a real spawned child running the processor. Replies must come back
in request order with the same records the processor gives in-process; a failure in the child must
fail the waiting requests loudly (never hang them); the child must not outlive its worker."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import Action, Anomaly, CheckpointEvent, StepEvent
from runwatch.contract.signing import verify_action
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.detector_process import DetectorProcess, DetectorProcessError, handle
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import PUBLIC, SEED

pytestmark = pytest.mark.integration  # starts processes (issue 25: not in `make test-fast`)

SECRET = SEED  # the workers' signing key
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def _nan_run(run_id: str = "run-1") -> list[tuple[bytes, bytes, int, int, float]]:
    """A run whose loss goes NaN from step 8 (a checkpoint at 1, confirmed at 7): an alert, then a
    rollback."""
    events = []
    for s in range(12):
        if s == 1:
            events.append(
                CheckpointEvent(run_id=run_id, step=1, uri="/ckpt/1.pt", ts=T0 + timedelta(seconds=s))
            )
        events.append(
            StepEvent(run_id=run_id, step=s, loss=math.nan if s >= 8 else 1.0, ts=T0 + timedelta(seconds=s))
        )
    return [(e.to_json(), run_id.encode(), 0, offset, e.ts.timestamp()) for offset, e in enumerate(events)]


@pytest.fixture
def detectors():
    process = DetectorProcess(RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}), SECRET)
    process.wait_ready(timeout=60)
    yield process
    process.close()


def _gather(*futures):
    async def wait():
        return await asyncio.wait_for(asyncio.gather(*futures), timeout=60)

    return wait()


def test_replies_come_back_in_order_with_the_records_the_processor_gives(detectors):
    events = _nan_run() + [(b"not json", b"run-1", 0, 99, None)]

    async def run():
        # Three requests in flight at once, answered in the order they were sent; an events request's
        # findings come ahead of its reply (the worker publishes them while the child snapshots the runs)
        sent = [
            detectors.submit("events", events[:6]),
            detectors.submit("events", events[6:]),
            detectors.submit("tick"),
        ]
        found = [await asyncio.wait_for(detectors.findings(reply), timeout=60) for reply in sent]
        return found, await _gather(*sent)

    found, (first, second, tick) = asyncio.run(run())
    assert found[0] == first.records == []  # healthy steps and a checkpoint publish nothing
    assert second.records == []  # (its findings came first, and no snapshot is due: state is off here)
    assert found[2] == []  # (a tick's findings come with its reply)
    second.records = found[1]
    assert [r.topic for r in second.records] == [
        topics.ANOMALIES,
        topics.ACTIONS,
        topics.ANOMALIES,
        topics.ACTIONS,
        topics.DEADLETTER,
    ]
    assert tick.records == []
    anomalies = [Anomaly.model_validate_json(r.value) for r in second.records if r.topic == topics.ANOMALIES]
    actions = [Action.model_validate_json(r.value) for r in second.records if r.topic == topics.ACTIONS]
    assert [(a.step, a.severity) for a in anomalies] == [(8, "warning"), (10, "critical")]
    assert [a.kind for a in actions] == ["alert", "rollback"]
    assert actions[1].target_checkpoint.uri == "/ckpt/1.pt"
    assert all(verify_action(a, PUBLIC) for a in actions)  # signed in the child with the workers' key
    assert all(r.key == b"run-1" for r in second.records)
    assert json.loads(second.records[-1].value)["offset"] == 99

    # The same events through the processor in this process give the same anomalies (same ids), each
    # stamped with the clock of the process that detected it.
    local = handle(TelemetryProcessor(RunwatchConfig(), SECRET), "events", events)

    def same(records):
        return [
            {k: v for k, v in json.loads(r.value).items() if k != "detected_at"}
            for r in records
            if r.topic == topics.ANOMALIES
        ]

    assert same(local.records) == same(second.records)
    assert all(json.loads(r.value)["detected_at"] for r in second.records if r.topic == topics.ANOMALIES)
    assert tick.counters.processed == 13 and tick.counters.deadlettered == 1
    assert tick.counters.actions == {"alert": 1, "rollback": 1}
    assert detectors.counters == tick.counters


def test_keep_partitions_drops_the_runs_of_lost_partitions(detectors):
    a = [(e, k, 0, o, t) for e, k, _p, o, t in _nan_run("run-a")[:3]]
    b = [(e, k, 1, o, t) for e, k, _p, o, t in _nan_run("run-b")[:3]]

    async def run():
        return await _gather(detectors.submit("events", a + b), detectors.submit("keep_partitions", {1}))

    _, kept = asyncio.run(run())
    assert kept.dropped_runs == ["run-a"]


def test_an_error_in_the_child_fails_the_waiting_and_later_requests(detectors):
    async def run():
        bad = detectors.submit("no-such-request")
        queued = detectors.submit("tick")  # sent before the failure was known
        results = await asyncio.wait_for(asyncio.gather(bad, queued, return_exceptions=True), timeout=60)
        later = detectors.submit("tick")
        return results, await asyncio.gather(later, return_exceptions=True)

    (bad, queued), (later,) = asyncio.run(run())
    for error in (bad, queued, later):
        assert isinstance(error, DetectorProcessError)
    assert "unknown request 'no-such-request'" in str(bad)  # the child's traceback is in the message


def test_a_killed_child_fails_the_waiting_requests(detectors):
    async def run():
        os.kill(detectors.pid, signal.SIGKILL)
        return await asyncio.wait_for(
            asyncio.gather(detectors.submit("tick"), return_exceptions=True), timeout=30
        )

    (error,) = asyncio.run(run())
    assert isinstance(error, DetectorProcessError)
    assert "exited with code -9" in str(error)


def test_close_stops_the_child(detectors):
    pid = detectors.pid
    detectors.close()
    assert not _alive(pid)


def test_the_child_exits_when_its_worker_is_killed(tmp_path):
    # A worker killed with SIGKILL runs no clean-up: its detector process must notice by itself.
    code = (
        "import os, sys, time\n"
        "from runwatch.detectors.config import RunwatchConfig\n"
        "from runwatch.worker.detector_process import DetectorProcess\n"
        "if __name__ == '__main__':\n"
        "    d = DetectorProcess(RunwatchConfig(), bytes(32))\n"
        "    d.wait_ready(60)\n"
        "    print(d.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    script = tmp_path / "worker.py"
    script.write_text(code)
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        assert _alive(child)
    finally:
        worker.kill()
        worker.wait(10)
    deadline = time.monotonic() + 15
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


class _EmptyStateTopic:
    """A ``runwatch.state`` with nothing in it (durable state on, nothing to restore)."""

    def read(self, partitions: set[int]) -> dict[str, bytes | None]:
        return {}

    def scan(self, topic: str, partitions: object, tail: int | None, timeout_s: float | None = None):
        return iter(())


def test_findings_are_handed_over_before_their_runs_are_snapshotted():
    # A run that emits a finding is snapshotted in the same request (run_states.py); its anomalies and
    # actions need not wait for the snapshot's pickling and signing: the worker publishes them meanwhile.
    from runwatch.worker.state.run_states import StateOptions

    processor = TelemetryProcessor(
        RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}),
        SECRET,
        state_reader=_EmptyStateTopic(),  # type: ignore[arg-type]
        state=StateOptions(),
        state_secret=bytes(range(32)),
    )
    handed: list[tuple[list[str], int]] = []
    snapshots_before = processor.counters.snapshots

    def findings(records):
        handed.append(([r.topic for r in records], processor.counters.snapshots))

    reply = handle(processor, "events", _nan_run(), findings=findings)
    assert handed == [
        ([topics.ANOMALIES, topics.ACTIONS, topics.ANOMALIES, topics.ACTIONS], snapshots_before)
    ]  # (handed over once, before any snapshot was taken)
    assert reply.records and {r.topic for r in reply.records} == {topics.STATE}
    assert processor.counters.snapshots > snapshots_before
