"""Issue 39: a crash report on the wire is bounded, never refused for its size; the capture's hooks publish
facts and chain what they found; the worker names the cause among ranks and picks the action (a restart
without the host, as it was, or a stop; never a third identical crash restarted, never a stopped run); the
remediator renders a restart as argument lists, refuses a forged host and runs nothing for a job it cannot
verify as the run's."""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from runwatch.contract.schema import (
    CRASH_TEXT_CHARS,
    Action,
    CrashEvent,
    RunStartEvent,
    SchemaError,
    StepEvent,
    decode_event,
)
from runwatch.contract.signing import sign_action
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.engine.crashes import valid_host
from runwatch.producer.publish.crash_capture import CLOSED_FILE, REPORTED_FILE, CrashCapture
from runwatch.producer.publish.launcher import OutputTail, death_facts
from runwatch.sinks.remediate.config import RemediationConfig
from runwatch.sinks.remediate.remediator import Remediator
from tests.support.action_keys import PUBLIC, WORKERS

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _crash(rank: int = 0, at: float = 0.0, **fields) -> CrashEvent:
    return CrashEvent(run_id="r", rank=rank, ts=T0 + timedelta(seconds=at), **fields)


# -- the wire ------------------------------------------------------------------------------------------


def test_a_huge_crash_report_is_cut_with_a_mark_never_refused():
    text = "x" * 100_000 + "\nValueError: the real last line\n"
    event = _crash(source="exception", traceback=text, log_tail=text, message="m" * 50_000, host="h" * 999)
    decoded = decode_event(event.to_json())
    assert decoded.truncated
    assert len(decoded.traceback) <= CRASH_TEXT_CHARS and decoded.traceback.endswith("the real last line\n")
    assert decoded.traceback.startswith("[traceback truncated: the first ")
    assert len(decoded.message) <= 4096 and len(decoded.host) <= 256


def test_binary_or_oversized_crash_messages_are_refused_whole():
    with pytest.raises(SchemaError):
        decode_event(b"\x00\xff\xfe crash" * 10)
    huge = orjson.loads(_crash(source="launcher").to_json()) | {"log_tail": "y" * 2_000_000}
    with pytest.raises(SchemaError, match="bytes"):
        decode_event(orjson.dumps(huge))


# -- the capture ----------------------------------------------------------------------------------------


class FakeRun:
    def __init__(self):
        self.run_id, self.last_step = "r", 7
        self.sent: list[dict] = []
        self.closed: list[str | None] = []

    def publish_crash(self, **fields):
        self.sent.append(fields)
        return True

    def close(self, timeout=10.0, status=None, summary=None):
        self.closed.append(status)


def test_excepthook_publishes_facts_calls_the_previous_hook_and_closes_the_run(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[0]))
    run = FakeRun()
    capture = CrashCapture(run, crash_dir=tmp_path, signals=False).install()
    try:
        try:
            raise ValueError("bad batch")
        except ValueError as exc:
            sys.excepthook(ValueError, exc, exc.__traceback__)
    finally:
        capture.uninstall()
    assert seen == [ValueError]  # the user's hook still ran
    [fields] = run.sent
    assert fields["source"] == "exception" and fields["exception_type"] == "ValueError"
    assert (
        "ValueError: bad batch" in fields["traceback"] and fields["step"] == 7 and "crash_class" not in fields
    )
    assert run.closed == ["failed"] and (tmp_path / REPORTED_FILE).exists()
    assert sys.excepthook is not capture._excepthook  # put back


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_dies_is_reported_without_ending_the_run(tmp_path):
    run = FakeRun()
    capture = CrashCapture(run, crash_dir=tmp_path, signals=False).install()
    try:
        t = threading.Thread(target=lambda: 1 / 0, name="loader")
        t.start()
        t.join()
    finally:
        capture.uninstall()
    assert [f["source"] for f in run.sent] == ["thread_exception"] and run.closed == []


def test_sigterm_chains_a_users_handler(tmp_path):
    import signal

    called = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: called.append(s))
    run = FakeRun()
    capture = CrashCapture(run, crash_dir=tmp_path).install()
    try:
        signal.raise_signal(signal.SIGTERM)
    finally:
        capture.uninstall()
        signal.signal(signal.SIGTERM, previous)
    assert called == [signal.SIGTERM]
    assert run.sent[0]["signal"] == 15 and run.closed == []  # the user's handler decides what follows


def test_the_launcher_reads_a_death_and_keeps_a_bounded_tail():
    assert death_facts(-11, False) == {"signal": 11}
    assert death_facts(0, True) == {"signal": 15, "exit_code": 0}
    assert death_facts(1, False) == {"exit_code": 1}
    tail = OutputTail(limit=100)
    for i in range(1000):
        tail.add(f"line {i}\n".encode())
    assert tail.text().endswith("line 999\n") and len(tail.text()) <= 100
    assert CLOSED_FILE != REPORTED_FILE


# -- the worker ----------------------------------------------------------------------------------------


def _monitor(world: int = 1) -> RunMonitor:
    m = RunMonitor("r", RunwatchConfig())
    m.observe(RunStartEvent(run_id="r", world_size=world, ts=T0, job_id="123"))
    return m


def _actions(out):
    return [(d.kind, d.params.get("mode"), d.params.get("exclude_hosts")) for d in out.decisions]


def test_a_segfault_restarts_without_its_host_and_a_forged_host_is_never_named():
    out = _monitor().observe(_crash(source="launcher", signal=11, host="node-7"))
    [finding] = out.anomalies
    assert finding.detector == "crash" and finding.evidence["crash_class"] == "segfault"
    assert finding.message.startswith("rank 0 crashed: segfault")
    assert _actions(out) == [("restart", "exclude_host", ["node-7"])]
    for forged in ("-rf", "node;reboot", "a b", "$(id)", "x..y"):
        assert valid_host(forged) is None
        out = _monitor().observe(_crash(source="launcher", signal=11, host=forged))
        assert _actions(out) == [("restart", "as_was", [])]


def test_user_code_stops_and_a_stopped_run_is_never_restarted():
    m = _monitor()
    out = m.observe(
        _crash(
            source="exception",
            exception_type="ValueError",
            traceback="Traceback (most recent call last):\nValueError: x",
        )
    )
    assert _actions(out) == [("stop", None, None)]
    m2 = _monitor()
    m2.policy.stopped = True  # stopped by its policy (a rollback cap); its exit code 3 then reported
    assert m2.observe(_crash(source="launcher", exit_code=3)).decisions == []


def test_the_same_crash_at_the_same_step_twice_is_not_restarted_a_third_time():
    m = _monitor()
    m.observe(StepEvent(run_id="r", step=40, ts=T0))
    first = m.observe(_crash(at=1, source="launcher", signal=11, host="n1", step=40))
    assert _actions(first)[0][0] == "restart"
    again = RunMonitor("r", RunwatchConfig())  # the next attempt: a fresh monitor, the history handed on
    again.take_crash_history(m.crash_ledger(), new_attempt=True)
    again.observe(RunStartEvent(run_id="r", world_size=1, ts=T0, attempt="2"))
    second = again.observe(_crash(at=2, source="launcher", signal=11, host="n2", step=40))
    assert _actions(second)[0][0] == "stop"
    assert "2 times" in second.decisions[0].reason


def test_the_earliest_death_is_the_cause_and_the_peers_are_consequences():
    m = _monitor(world=4)
    # a peer's error arrives first, but the killed rank died earlier
    out = m.observe(
        _crash(
            rank=3,
            at=1.0,
            source="exception",
            exception_type="RuntimeError",
            message="Connection closed by peer",
        )
    )
    out2 = m.observe(_crash(rank=2, at=0.4, source="launcher", signal=9, host="n2"))
    assert out.anomalies == out2.anomalies == []  # gathered for settle_s
    settled = m.tick(T0 + timedelta(seconds=4))
    roles = {(a.rank, a.evidence["role"], a.severity) for a in settled.anomalies}
    assert roles == {(2, "cause", "critical"), (3, "consequence", "info")}
    assert [d.kind for d in settled.decisions] == ["restart"]
    late = m.observe(_crash(rank=1, at=5, source="exception", exception_type="RuntimeError", message="x"))
    assert late.decisions == [] and late.anomalies[0].evidence["role"] == "consequence"


def test_a_crash_after_run_end_is_still_judged():
    m = _monitor(world=2)
    from runwatch.contract.schema import RunEndEvent

    m.observe(RunEndEvent(run_id="r", ts=T0, status="failed"))
    m.observe(_crash(rank=1, at=0.5, source="launcher", signal=11, host="n1"))
    out = m.finish()
    assert [a.evidence["crash_class"] for a in out.anomalies] == ["segfault"]


# -- the remediator --------------------------------------------------------------------------------------


NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _restart(**params) -> bytes:
    action = Action(
        action_id="a1",
        run_id="run-1",
        kind="restart",
        reason="rank 0 crashed",
        issued_at=NOW,
        expires_at=NOW + timedelta(seconds=120),
        params={"job_id": "777", "crash_class": "hardware", **params},
    )
    return sign_action(action, WORKERS).to_json()


def _slurm(tmp_path: Path, owner: str = "run-1", excluded=None):
    script = tmp_path / "verify.py"
    script.write_text(f"print({owner!r})\n")
    config = RemediationConfig.model_validate(
        {
            "rules": [
                {
                    "kinds": ["restart"],
                    "verify": {"argv": [sys.executable, str(script), "{job_id}"]},
                    "commands": [
                        {"argv": ["scontrol", "update", "JobId={job_id}", "ExcNodeList={exclude_hosts}"]},
                        {"argv": ["scontrol", "requeue", "{job_id}"]},
                    ],
                }
            ]
        }
    )
    calls: list[list[str]] = []
    rem = Remediator(
        config,
        PUBLIC,
        runner=lambda argv, t: calls.append(argv) or ("ok", 0, ""),
        now=lambda: NOW,
        excluded=excluded,
    )
    return rem, calls


def test_a_restart_without_a_host_renders_slurm_argument_lists(tmp_path):
    rem, calls = _slurm(tmp_path)
    done = rem.handle(_restart(mode="exclude_host", exclude_hosts=["node-7", "node-9"]))
    assert [e.status for e in done] == ["ok", "ok"]
    assert calls == [
        ["scontrol", "update", "JobId=777", "ExcNodeList=node-7,node-9"],
        ["scontrol", "requeue", "777"],
    ]


def test_a_restart_without_its_host_also_leaves_out_the_hosts_its_history_names(tmp_path):
    # (the consumer's ``excluded`` is hosts.exclude_list: the action's hosts, then the job's lemon hosts)
    seen = []

    def history(action, meta):
        seen.append(action.params["exclude_hosts"])
        return [*action.params["exclude_hosts"], "node-4"]

    rem, calls = _slurm(tmp_path, excluded=history)
    rem.handle(_restart(mode="exclude_host", exclude_hosts=["node-7"]))
    assert seen == [["node-7"]]
    assert calls[0] == ["scontrol", "update", "JobId=777", "ExcNodeList=node-7,node-4"]


def test_a_forged_host_from_the_history_refuses_the_list_and_unreadable_history_is_no_help(tmp_path):
    rem, calls = _slurm(tmp_path, excluded=lambda a, m: ["node-7", "-rf;reboot"])
    rem.handle(_restart(mode="exclude_host", exclude_hosts=["node-7"]))
    # the exclusion is refused whole (as for a forged host in the action), nothing forged reaches an argv
    assert not any(c[:2] == ["scontrol", "update"] for c in calls)
    assert not any("reboot" in arg for c in calls for arg in c)

    def broken(action, meta):
        raise RuntimeError("the store is away")

    rem, calls = _slurm(tmp_path, excluded=broken)
    rem.handle(_restart(mode="exclude_host", exclude_hosts=["node-7"]))
    assert calls[0] == ["scontrol", "update", "JobId=777", "ExcNodeList=node-7"]


def test_a_restart_as_it_was_skips_the_exclusion(tmp_path):
    rem, calls = _slurm(tmp_path)
    done = rem.handle(_restart(mode="as_was", exclude_hosts=[]))
    assert [e.status for e in done] == ["skipped", "ok"] and calls == [["scontrol", "requeue", "777"]]


@pytest.mark.parametrize("host", ["-x", "node;reboot", "n1 n2", "$(id)", "a,b", "../etc", "x\n"])
def test_a_forged_host_is_refused_and_nothing_excludes_it(tmp_path, host):
    rem, calls = _slurm(tmp_path)
    done = rem.handle(_restart(mode="exclude_host", exclude_hosts=["node-1", host]))
    assert done[0].status == "refused" and all(host not in " ".join(argv) for argv in calls)


def test_a_restart_is_never_issued_for_a_job_not_verified_as_the_runs(tmp_path):
    rem, calls = _slurm(tmp_path, owner="other-team-run")
    done = rem.handle(_restart(mode="as_was", exclude_hosts=[]))
    assert calls == [] and [e.status for e in done] == ["skipped", "unverified"]
