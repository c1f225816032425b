"""Hosts that keep failing (issue 39): a 20-run history of one 4-rank job on a pool of 6 hosts, stored in
the embedded ClickHouse by the sink's writer, as the sink stores what the producer and the worker send:
rank 0's run_start (its host, the job id), every rank's first heartbeat (its host, as the heartbeat
thread sends it), and the findings. One host is the straggler host in two runs and the crash host in a
third: it is named with exactly those run ids, and `runwatch hosts` prints it; the restart's exclude list
takes it. The same 20 runs without the fault name no host, though they hold run-wide stalls (every rank
of a run) and findings about whole runs; nor does a job that ran on one host, however often it fails."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from runwatch.cli.main import main as cli
from runwatch.contract.schema import Anomaly, HeartbeatEvent, RunStartEvent, StepEvent
from runwatch.producer.instrument.heartbeat import Heartbeat
from runwatch.sinks import ClickHouseSink
from runwatch.sinks.hosts import LemonHost, exclude_list, lemon_hosts

pytestmark = pytest.mark.integration

JOB = "pretrain-7b"
POOL = [f"node-{i:02d}" for i in range(6)]
LEMON = "node-04"
RANKS = 4
STRAGGLER_RUNS = (4, 9)  # the runs whose straggler rank is on LEMON
CRASH_RUN = 16  # the run that crashed on LEMON


def hosts_of(i: int) -> list[str]:
    """Run ``i``'s hosts, rank by rank: four of the pool, rotating (LEMON is in most runs)."""
    return [POOL[(i + k) % len(POOL)] for k in range(RANKS)]


class _Recorder:
    """A publisher that keeps the heartbeat thread's events (RunWatch.heartbeat's signature)."""

    def __init__(self, run_id: str, rank: int, ts: datetime):
        self.run_id, self.rank, self.ts, self.events = run_id, rank, ts, []

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, in_sync=None, interval_s=None,
                  host_load=None, host=None):  # fmt: skip
        self.ts += timedelta(seconds=1)
        fields = {"host": host} if host else {}
        self.events.append(
            HeartbeatEvent(run_id=self.run_id, rank=self.rank, ts=self.ts, step=step, **fields)
        )
        return True


def rank_heartbeats(run_id: str, rank: int, host: str, ts: datetime) -> list[HeartbeatEvent]:
    """Two heartbeats of one rank as the real heartbeat thread makes them (its host on the first), with the
    host name this rank's machine would say."""
    recorder = _Recorder(run_id, rank, ts)
    beat = Heartbeat(recorder, interval_s=1.0, host_load=False, stacks_after_s=None)
    beat._host = host  # (the machine's name, as socket.gethostname says it there)
    beat.beat()
    beat.beat()
    assert recorder.events[0].host == host and recorder.events[1].host is None
    return recorder.events


def finding(run_id: str, detector: str, ts: datetime, rank: int | None, **evidence) -> Anomaly:
    return Anomaly(
        anomaly_id=f"{run_id}-{detector}-{rank}",
        run_id=run_id,
        detector=detector,
        metric="m",
        severity="warning",
        message=f"{detector} on rank {rank}",
        ts=ts,
        rank=rank,
        step=40,
        evidence=evidence,
    )


def store_history(sink: ClickHouseSink, *, faulty: bool, job: str = JOB, one_host: bool = False) -> list[str]:
    """20 runs of ``job``, a day apart, ending yesterday; returns their ids, oldest first."""
    now = datetime.now(UTC)
    run_ids = []
    for i in range(20):
        run_id = f"{job}-{'f' if faulty else 'c'}-{i:02d}"
        run_ids.append(run_id)
        start = now - timedelta(days=21 - i)
        hosts = [POOL[0]] * RANKS if one_host else hosts_of(i)
        events: list = [RunStartEvent(run_id=run_id, ts=start, job_id=job, host=hosts[0], world_size=RANKS)]
        for rank, host in enumerate(hosts):
            events += rank_heartbeats(run_id, rank, host, start)
            events.append(StepEvent(run_id=run_id, rank=rank, ts=start + timedelta(seconds=5), step=1))
        anomalies = []
        at = start + timedelta(minutes=10)
        if i % 7 == 3:  # a run-wide stall: every rank, so every host of the run
            anomalies += [finding(run_id, "stall", at, r) for r in range(RANKS)]
        if i % 5 == 0:  # about the run as a whole (no rank)
            anomalies.append(finding(run_id, "throughput_drift", at, None))
        if faulty and (i in STRAGGLER_RUNS or one_host and i in (2, 9, 13)):
            anomalies.append(finding(run_id, "straggler", at, hosts.index(LEMON) if not one_host else 2))
        if faulty and i == CRASH_RUN and not one_host:
            rank = hosts.index(LEMON)
            anomalies.append(finding(run_id, "crash", at, rank, host=LEMON, crash_class="hardware"))
        sink.writer.write_events(events)
        sink.writer.write_anomalies(anomalies)
    return run_ids


@pytest.fixture(scope="module")
def stores(chdb_dsn):
    """A faulty and a clean history, each in a database of its own in the session's ClickHouse."""
    made = {}
    # (the faulty one in the default database, where `runwatch hosts` reads it)
    for name, faulty, database in (("faulty", True, "runwatch"), ("clean", False, "hosts_clean")):
        sink = ClickHouseSink(chdb_dsn, database=database)
        sink.migrate()
        made[name] = (sink, store_history(sink, faulty=faulty))
    yield made


def test_the_lemon_host_is_named_with_its_runs(stores):
    sink, run_ids = stores["faulty"]
    assert LEMON in hosts_of(STRAGGLER_RUNS[0]) and LEMON in hosts_of(CRASH_RUN)
    named = lemon_hosts(sink, job=JOB, window_days=30, min_runs=3)
    expected = [run_ids[i] for i in sorted((*STRAGGLER_RUNS, CRASH_RUN))]
    assert named == [LemonHost(host=LEMON, run_ids=expected, findings=2, crashes=1)]
    # two runs are not yet a pattern; another job's history is not this one's
    assert lemon_hosts(sink, job=JOB, window_days=30, min_runs=4) == []
    assert lemon_hosts(sink, job="another-job", window_days=30, min_runs=3) == []
    # a window that starts after the first straggler run leaves two runs
    assert lemon_hosts(sink, job=JOB, window_days=11, min_runs=3) == []


def test_the_clean_history_names_no_host(stores):
    sink, _ = stores["clean"]
    assert lemon_hosts(sink, job=JOB, window_days=30, min_runs=3) == []
    assert (
        lemon_hosts(sink, job=None, window_days=30, min_runs=1) == []
    )  # (the run-wide stalls count for none)


def test_a_job_on_one_host_names_nothing(chdb_dsn):
    sink = ClickHouseSink(chdb_dsn, database="hosts_single")
    sink.migrate()
    store_history(sink, faulty=True, job="single-node", one_host=True)
    assert lemon_hosts(sink, job="single-node", window_days=30, min_runs=3) == []


def test_the_restart_exclude_list_takes_the_lemon(stores):
    sink, _ = stores["faulty"]
    assert exclude_list(sink, JOB, ["node-01"]) == ["node-01", LEMON]
    assert exclude_list(sink, JOB, [LEMON]) == [LEMON]
    clean, _ = stores["clean"]
    assert exclude_list(clean, JOB, ["node-01"]) == ["node-01"]


def test_runwatch_hosts_prints_them(stores, chdb_dsn):
    sink, run_ids = stores["faulty"]
    args = ["hosts", "--job", JOB, "--dsn", chdb_dsn]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [h["host"] for h in out["hosts"]] == [LEMON]
    assert out["hosts"][0]["run_ids"] == [run_ids[i] for i in sorted((*STRAGGLER_RUNS, CRASH_RUN))]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0 and LEMON in text.output and run_ids[CRASH_RUN] in text.output


def test_the_report_of_a_run_of_the_job_names_them(stores):
    from runwatch.sinks.report import build_report

    sink, run_ids = stores["faulty"]
    html, _ = build_report(sink, run_ids[-1])
    assert f"Hosts that keep failing (job {JOB})" in html and f"<td>{LEMON}</td>" in html
    clean, clean_ids = stores["clean"]
    html, _ = build_report(clean, clean_ids[-1])
    assert f"No host of job {JOB} keeps failing." in html
