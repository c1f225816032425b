"""The CI gate end to end: recorded runs of one job at commits of a real git repository, loaded
with ``runwatch ingest`` into the embedded ClickHouse, judged by ``runwatch baseline check`` and
scanned by ``runwatch baseline scan``."""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from runwatch.cli.main import main
from runwatch.producer.publish.recorder import JsonlRecorder
from runwatch.scenarios.clocks import SimulatedClock
from runwatch.sinks.clickhouse import ClickHouseSink
from runwatch.sinks.summaries import SummaryUpkeep

pytestmark = pytest.mark.integration

# Long past: older than the telemetry table's 90-day TTL, so the summaries must come from the
# recordings themselves (what `runwatch ingest` of an old recording relies on).
T0 = datetime(2025, 5, 1, 9, 0, tzinfo=UTC)
STEPS = 60


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.com",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.com",
            "PATH": "/usr/bin:/bin",
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": str(repo),
        },
    )
    return done.stdout.strip()


def make_repo(path: Path, subjects: list[str]) -> list[str]:
    """A git repository with one commit per subject; their shas, oldest first."""
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    shas = []
    for i, subject in enumerate(subjects):
        (path / "train.py").write_text(f"# revision {i}: {subject}\n")
        git(path, "add", "train.py")
        git(path, "commit", "-q", "-m", subject)
        shas.append(git(path, "rev-parse", "HEAD"))
    return shas


def record_run(
    out: Path, run_id: str, key: str, sha: str, day: int, step_time: float, seed: int, start: datetime = T0
) -> Path:
    """A short run recorded as its trainer would (JsonlRecorder) on a simulated clock starting
    ``day`` days after ``start``: ``step_time`` seconds a step (1% noise), the same loss curve every run."""
    rng = random.Random(seed)
    clock = SimulatedClock(start=start + timedelta(days=day))
    path = out / f"{run_id}.jsonl"
    rec = JsonlRecorder(
        path,
        run_id,
        clock=clock.now,
        collect_metadata=False,
        baseline_key=key,
        tags={"hardware": "test-cpu", "git_commit_time": (start + timedelta(days=day)).isoformat()},
        run_start={"git_sha": sha, "git_dirty": False},
    )
    for step in range(1, STEPS + 1):
        dt = step_time * (1 + rng.gauss(0, 0.01))
        clock.advance(dt)
        rec.step(
            step,
            loss=2.0 / (1 + 0.05 * step) * (1 + rng.gauss(0, 0.002)),
            step_time_s=dt,
            data_wait_s=0.1 * dt,
            memory={"host_rss": 900_000_000 + rng.randrange(1_000_000)},
        )
    rec.close("completed")
    return path


@pytest.fixture
def history(tmp_path):
    """12 runs of one job, one a day: 8 at the first four commits, then 4 at the two commits from
    "slower data loader" on, their step times 20% longer."""
    subjects = [
        "initial trainer",
        "docs: usage",
        "refactor the loop",
        "tidy imports",
        "slower data loader",
        "docs: after",
    ]
    repo = tmp_path / "repo"
    shas = make_repo(repo, subjects)
    key = f"job-{uuid.uuid4().hex[:8]}"  # the engine is shared by the tests in this process
    at = [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 5, 5]
    runs = [f"{key}-r{i:02d}" for i in range(12)]
    recordings = tmp_path / "recordings"
    recordings.mkdir()
    for i, run_id in enumerate(runs):
        record_run(
            recordings, run_id, key, shas[at[i]], day=i, step_time=0.2 * (1.2 if i >= 8 else 1.0), seed=i
        )
    return {"repo": repo, "shas": shas, "key": key, "runs": runs, "recordings": recordings}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_ingest_then_the_gate_passes_a_normal_run_fails_a_slower_one_and_names_the_commit(history, chdb_dsn):
    runs, shas, repo = history["runs"], history["shas"], history["repo"]
    done = invoke("ingest", str(history["recordings"]), "--dsn", chdb_dsn, "--loss-every", "20")
    assert done.exit_code == 0, done.output
    assert "12 run(s)" in done.output

    normal = invoke("baseline", "check", runs[7], "--dsn", chdb_dsn, "--git-repo", str(repo))
    assert normal.exit_code == 0, normal.output
    assert "every metric normal" in normal.output

    slower = invoke("baseline", "check", runs[8], "--dsn", chdb_dsn, "--git-repo", str(repo))
    assert slower.exit_code == 1, slower.output
    assert "step_time_median_s" in slower.output and "OUTLIER" in slower.output
    assert f"commits {shas[3][:12]}..{shas[4][:12]}:" in slower.output
    assert f"{shas[4][:12]} slower data loader" in slower.output
    assert "tidy imports" not in slower.output  # the last normal run's own commit is not in the range

    as_json = invoke("baseline", "check", runs[8], "--dsn", chdb_dsn, "--git-repo", str(repo), "--json")
    report = json.loads(as_json.output)
    assert as_json.exit_code == 1 and report["exit_code"] == 1
    assert "step_time_median_s" in report["outliers"] and report["last_normal_run"] == runs[7]
    assert [c["subject"] for c in report["commit_range"]["commits"]] == ["slower data loader"]
    step = next(c for c in report["comparisons"] if c["metric"] == "step_time_median_s")
    assert step["n"] == 8 and step["change"] == pytest.approx(0.2, abs=0.03)
    assert (
        next(c for c in report["comparisons"] if c["metric"] == "max_host_rss_bytes")["verdict"] == "normal"
    )

    # a later slow run: the runs already regressed are in its history, the range still starts before them
    later = invoke("baseline", "check", runs[10], "--dsn", chdb_dsn, "--git-repo", str(repo), "--markdown")
    assert later.exit_code == 1, later.output
    assert "🔴 OUTLIER" in later.output and "slower data loader" in later.output

    # a tolerance from the config's baseline section (as `runwatch calibrate` writes it): +20% is within 50%
    tolerant = history["recordings"].parent / "tolerances.yaml"
    tolerant.write_text(
        "baseline:\n  min_change:\n    step_time_median_s: 0.5\n    step_time_p95_s: 0.5\n"
        "    training_time_s: 0.5\n"
    )
    within = invoke("baseline", "check", runs[8], "--dsn", chdb_dsn, "--config", str(tolerant), "--json")
    assert within.exit_code == 0, within.output
    assert (
        next(c for c in json.loads(within.output)["comparisons"] if c["metric"] == "step_time_median_s")[
            "verdict"
        ]
        == "normal"
    )

    few = invoke("baseline", "check", runs[2], "--dsn", chdb_dsn)
    assert few.exit_code == 0 and "insufficient history (2 run(s)" in few.output

    unknown = invoke("baseline", "check", "no-such-run", "--dsn", chdb_dsn)
    assert unknown.exit_code == 2 and "unknown run 'no-such-run'" in unknown.output
    not_repo = invoke(
        "baseline", "check", runs[8], "--dsn", chdb_dsn, "--git-repo", str(history["recordings"])
    )
    assert not_repo.exit_code == 2 and "not a git repository" in not_repo.output

    scan = invoke(
        "baseline",
        "scan",
        "--baseline-key",
        history["key"],
        "--dsn",
        chdb_dsn,
        "--git-repo",
        str(repo),
        "--json",
    )
    assert scan.exit_code == 0, scan.output
    points = json.loads(scan.output)["change_points"]
    step_points = [p for p in points if p["metric"] == "step_time_median_s"]
    assert [(p["run_id"], p["git_sha"], p["kind"], p["subject"]) for p in step_points] == [
        (runs[8], shas[4], "regression", "slower data loader")
    ]
    assert step_points[0]["commit_time"] is not None
    assert not [p for p in points if p["metric"] in ("max_host_rss_bytes", "final_loss")]  # unchanged
    text = invoke("baseline", "scan", "--baseline-key", history["key"], "--dsn", chdb_dsn)
    assert f"first at run {runs[8]}, commit {shas[4][:12]}" in text.output


def test_ingest_refuses_what_it_cannot_read(tmp_path, chdb_dsn):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "step"}\n')
    done = invoke("ingest", str(bad), "--dsn", chdb_dsn)
    assert done.exit_code == 2 and "bad.jsonl:1" in done.output
    missing = invoke("ingest", str(tmp_path / "nothing.jsonl"), "--dsn", chdb_dsn)
    assert missing.exit_code == 2 and "no such file" in missing.output
    unreachable = invoke("baseline", "check", "r", "--dsn", "http://127.0.0.1:9/")
    assert unreachable.exit_code == 2 and "error:" in unreachable.output


def test_the_sinks_upkeep_summarises_ended_runs_and_runs_whose_events_stopped(tmp_path, chdb_dsn):
    from runwatch.detectors.offline.replay import read_events

    key = f"job-{uuid.uuid4().hex[:8]}"
    recent = datetime.now(UTC).replace(microsecond=0) - timedelta(days=3)  # inside the telemetry TTL
    ended = record_run(tmp_path, f"{key}-ended", key, "a" * 40, day=0, step_time=0.2, seed=1, start=recent)
    died_events = [
        e
        for e in read_events(
            record_run(tmp_path, f"{key}-died", key, "b" * 40, day=1, step_time=0.2, seed=2, start=recent)
        )
        if e.kind != "run_end"
    ]
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    try:
        sink.writer.write_events(read_events(ended))
        sink.writer.write_events(died_events)
        last = max(e.ts for e in died_events)
        ticks = iter(range(1000))
        upkeep = SummaryUpkeep(
            sink,
            died_after_s=600,
            interval_s=30,
            clock=lambda: float(next(ticks) * 10),
            now=lambda: last + timedelta(seconds=601),
        )
        upkeep.ended({f"{key}-ended"})
        summary = sink.baselines.summary(f"{key}-ended")
        assert summary is not None and summary.status == "completed" and summary.metrics["steps"] == STEPS
        assert summary.git_sha == "a" * 40 and summary.baseline_key == key
        assert sink.baselines.summary(f"{key}-died") is None
        upkeep.tick()  # t=10: not yet an interval
        assert sink.baselines.summary(f"{key}-died") is None
        for _ in range(3):
            upkeep.tick()
        died = sink.baselines.summary(f"{key}-died")
        assert died is not None and died.status == "died"
        assert abs(died.ended_at - last) < timedelta(milliseconds=1)  # the column keeps milliseconds
        assert f"{key}-died" not in sink.runs.to_summarize(last + timedelta(days=1), 600)
        assert upkeep.errors == 0
        # an unreachable ClickHouse is logged and retried, never raised
        broken = SummaryUpkeep(ClickHouseSink(chdb_dsn), interval_s=0)
        broken.sink.close()
        broken.ended({f"{key}-ended"})
        broken.tick()
        assert broken.errors >= 2
    finally:
        sink.close()


def test_the_sink_consumer_summarises_a_run_when_its_run_end_is_stored(broker, chdb_dsn, tmp_path):
    import threading

    from kafka import KafkaProducer

    from runwatch.contract import topics
    from runwatch.detectors.offline.replay import read_events
    from runwatch.sinks import SinkConsumer
    from tests.conftest import eventually

    run_id = f"sunk-{uuid.uuid4().hex[:8]}"
    rec = JsonlRecorder(
        tmp_path / "run.jsonl",
        run_id,
        collect_metadata=False,
        baseline_key="sunk-job",
        run_start={"git_sha": "c" * 40},
    )
    for step in range(1, 21):
        rec.step(step, loss=1.0 / step, step_time_s=0.1)
    rec.close("completed")
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
    for event in read_events(tmp_path / "run.jsonl"):
        producer.send(topics.TELEMETRY, key=run_id.encode(), value=event.to_json())
    producer.flush()
    producer.close()
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    consumer = SinkConsumer(sink, broker.bootstrap, group_id=f"sink-test-{run_id}", batch_interval_s=0.2)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    reader = ClickHouseSink(chdb_dsn)  # not the consumer's client, which its thread is using
    try:
        summary = eventually(lambda: reader.baselines.summary(run_id), 60, "the run's summary", interval=0.2)
    finally:
        consumer.stopping.set()
        thread.join(30)
        sink.close()
        reader.close()
    assert summary.status == "completed" and summary.metrics["steps"] == 20 and summary.git_sha == "c" * 40
    assert summary.metrics["step_time_median_s"] == pytest.approx(0.1)
