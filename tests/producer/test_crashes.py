"""Real crashes (issue 39): processes started the way users start them (``runwatch launch -- python ...``)
against the session broker and a real worker. Each death yields a ``crash`` finding of the right class
within 10 s of the death (the finding's record time against the death time the launcher records) and the
right action on the action topic: an exception in the loop -> user_code -> stop; SIGSEGV -> segfault ->
restart without the host; SIGTERM -> preemption -> restart as it was; host OOM (an allocation over the
process's address-space limit) -> oom_host -> restart without the host; one rank of a 4-rank gloo DDP run
SIGKILLed -> unknown (no OOM evidence) -> restart as it was, the peers' crashes its consequences."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import Action, Anomaly
from runwatch.local.broker import free_port
from tests.conftest import read_topic

pytestmark = pytest.mark.integration

HERE = Path(__file__).parents[1] / "support"  # (the training scripts)
DEATH_LINE = re.compile(r"runwatch launch: .* ended with (signal -?\d+|exit code -?\d+) at ([^;\s]+)")
WITHIN_S = 10.0


def launch(run_id: str, bootstrap: str, argv: list[str], log: Path, rank: int = 0, world: int = 1):
    cmd = [sys.executable, "-m", "runwatch.cli", "launch", "--run-id", run_id, "--rank", str(rank)]
    cmd += ["--world-size", str(world), "--bootstrap", bootstrap, "--", sys.executable, *argv]
    out = log.open("wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), out


def died_at(log: Path) -> datetime:
    match = DEATH_LINE.search(log.read_text(errors="replace"))
    assert match, log.read_text(errors="replace")[-3000:]
    return datetime.fromisoformat(match.group(2))


def crash_cause(bootstrap: str, run_id: str, timeout: float = 60.0):
    """The run's cause finding (and its record time, s since the epoch) and its action."""

    def found(records: list) -> bool:
        return any(_cause(r, run_id) for r in records)

    records = read_topic(bootstrap, topics.ANOMALIES, found, timeout)
    record = next(r for r in records if _cause(r, run_id))
    anomaly = Anomaly.model_validate_json(record.value)
    actions = read_topic(
        bootstrap,
        topics.ACTIONS,
        lambda rs: any(_action(r, anomaly.anomaly_id) for r in rs),
        timeout,
    )
    action = Action.model_validate_json(next(r for r in actions if _action(r, anomaly.anomaly_id)).value)
    return anomaly, record.timestamp / 1000.0, action


def _cause(record, run_id: str) -> bool:
    if record.key != run_id.encode():
        return False
    a = Anomaly.model_validate_json(record.value)
    return a.detector == "crash" and a.evidence.get("role") == "cause"


def _action(record, anomaly_id: str) -> bool:
    a = Action.model_validate_json(record.value)
    return anomaly_id in a.anomaly_ids


def run_single(broker, tmp_path: Path, death: str) -> tuple[Anomaly, float, Action, Path]:
    run_id = f"crash-{death}-{uuid.uuid4().hex[:8]}"
    log = tmp_path / f"{death}.log"
    argv = [str(HERE / "crash_train.py"), "--run-id", run_id, "--bootstrap", broker.bootstrap]
    argv += ["--death", death]
    proc, out = launch(run_id, broker.bootstrap, argv, log)
    try:
        if death == "term":
            deadline = time.monotonic() + 60
            while b"waiting for SIGTERM" not in log.read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)  # the scheduler's preemption, to the launcher as Slurm sends it
        proc.wait(timeout=90)
        anomaly, received, action = crash_cause(broker.bootstrap, run_id)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        out.close()
    latency = received - died_at(log).timestamp()
    print(f"{death}: {anomaly.evidence['crash_class']} {action.kind} {latency:.2f} s after the death")
    assert latency < WITHIN_S, (death, latency)
    return anomaly, latency, action, log


@pytest.mark.parametrize(
    ("death", "crash_class", "kind", "mode"),
    [
        ("raise", "user_code", "stop", None),
        ("segv", "segfault", "restart", "exclude_host"),
        ("term", "preemption", "restart", "as_was"),
        ("oom", "oom_host", "restart", "exclude_host"),
    ],
)
def test_a_crash_is_classified_and_acted_on(broker, worker, tmp_path, death, crash_class, kind, mode):
    anomaly, _latency, action, log = run_single(broker, tmp_path, death)
    assert anomaly.evidence["crash_class"] == crash_class, anomaly.evidence
    assert anomaly.evidence["evidence_line"]
    assert action.kind == kind, action
    assert action.params["crash_class"] == crash_class
    if kind == "restart":
        assert action.params["mode"] == mode
        assert action.params["exclude_hosts"] == (
            [anomaly.evidence["host"]] if mode == "exclude_host" else []
        )
    if death == "segv":  # the faulthandler file's text went with the launcher's report
        crash = next(e for e in _crash_events(broker.bootstrap, anomaly.run_id) if e["source"] == "launcher")
        assert "Fatal Python error: Segmentation fault" in crash["log_tail"], crash


def _crash_events(bootstrap: str, run_id: str) -> list[dict]:
    import orjson

    records = read_topic(
        bootstrap,
        topics.TELEMETRY,
        lambda rs: any(r.key == run_id.encode() and b'"crash"' in r.value for r in rs),
    )
    events = [orjson.loads(r.value) for r in records if r.key == run_id.encode()]
    return [e for e in events if e["kind"] == "crash"]


def test_one_rank_killed_of_four_is_the_cause(broker, worker, tmp_path):
    run_id = f"crash-kill4-{uuid.uuid4().hex[:8]}"
    port, world, victim = free_port(), 4, 2
    procs = []
    try:
        for rank in range(world):
            argv = [str(HERE / "dist_train.py"), "--rank", str(rank), "--world", str(world)]
            argv += ["--port", str(port), "--bootstrap", broker.bootstrap, "--run-id", run_id]
            argv += [
                "--out",
                str(tmp_path),
                "--steps",
                "400",
                "--step-sleep",
                "0.05",
                "--fault",
                f"kill:{victim}:15",
            ]
            procs.append(launch(run_id, broker.bootstrap, argv, tmp_path / f"rank{rank}.log", rank, world))
        procs[victim][0].wait(timeout=180)
        anomaly, received, action = crash_cause(broker.bootstrap, run_id, timeout=60)
    finally:
        for proc, out in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            out.close()
    latency = received - died_at(tmp_path / f"rank{victim}.log").timestamp()
    print(f"kill 1 of 4: {anomaly.evidence['crash_class']} {action.kind} {latency:.2f} s after the death")
    assert anomaly.rank == victim and anomaly.evidence["signal"] == signal.SIGKILL
    assert anomaly.evidence["crash_class"] == "unknown"
    assert action.kind == "restart" and action.params["mode"] == "as_was"
    assert latency < WITHIN_S
    # one action for the run, never one per rank
    actions = read_topic(broker.bootstrap, topics.ACTIONS, lambda rs: True, 5)
    ours = [Action.model_validate_json(r.value) for r in actions if r.key == run_id.encode()]
    assert [a.kind for a in ours if a.kind in ("restart", "stop")] == ["restart"]
