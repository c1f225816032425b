"""Issue 23's numbered field cases, one regression test each, on the real broker, worker, sink and
remediator: a record that crash-looped every worker, a requeued job, the stop of an earlier attempt, a
worker pointed at nothing, records on the wrong partition or with no key, run ids that forge log lines,
rows the sink could not keep as sent, forged actions, and a trainer reading every run's actions.
(Cases 4 and 5, a flood of runs that never end and the restore after it, are not covered yet.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import Action, StepEvent, decode_action
from runwatch.contract.signing import sign_action
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from tests.conftest import eventually, read_topic
from tests.worker.test_poison_cases import (
    assert_fault_found,
    deadletters,
    dumps,
    event,
    new_run,
    partition_of,
    producer,  # noqa: F401 - a fixture
    publish_fault_run,
    run_on_partition_of,
    send,
    unharmed,  # noqa: F401 - a fixture
    wait_committed_past,
)

pytestmark = pytest.mark.integration

Y9999_MS = 253402300799000  # 9999-12-31T23:59:59Z as a record timestamp
STATE_KEY = {"RUNWATCH_STATE_SECRET": "a-state-key-of-the-workers-32-bytes-or-more"}  # a worker's own


# -- case 1: one record crash-looped every worker -------------------------------------------------


def test_case1_the_crash_loop_record_among_ten_live_runs_is_deadlettered_and_every_fault_acted_on(
    broker,
    unharmed,  # noqa: F811 - the fixture imported above
    producer,  # noqa: F811
):
    poison_runs = [new_run("y9999-rec") for _ in range(2)]
    live = [new_run("live10") for _ in range(10)]
    # The reproduction: ts 9999-12-31 with a record time of 0, and the same with a record time
    # of 9999-12-31 (both were accepted unchecked, and the tick's overflow killed the detector process).
    for run_id, record_ms in zip(poison_runs, (0, Y9999_MS), strict=True):
        body = dumps(event(run_id, ts="9999-12-31T23:59:59Z", step=1, loss=2.0, event_id="e1"))
        send(producer, run_id.encode(), body, timestamp_ms=record_ms).get(timeout=10)
    last = [publish_fault_run(producer, run_id) for run_id in live]

    for run_id in live:
        assert_fault_found(broker.bootstrap, run_id)  # an alert and a rollback for every live run
    for run_id in poison_runs:
        (letter,) = deadletters(broker.bootstrap, run_id.encode(), 1)
        assert letter.reason.startswith("limits: ts: 9999-12-31") and "receive time" in letter.reason, (
            letter.reason
        )
    for meta in last:
        wait_committed_past(broker.bootstrap, meta.partition, meta.offset)
    time.sleep(1.0)  # a few ticks (every 0.25 s) after the poison: the fixture checks nothing restarted


# -- case 7: a record with no key, or on another partition than its key's --------------------------


def test_case7_records_without_a_key_or_on_the_wrong_partition_are_deadlettered(broker, unharmed, producer):  # noqa: F811
    run_id = new_run("stray")
    key = run_id.encode()
    home = partition_of(key)
    stray_partition = (home + 1) % topics.DEFAULT_PARTITIONS
    # The run's own NaN streak on its partition, with a stray step of the same run on another partition
    # at a high offset: it must neither split the run nor move its replay marker.
    stray = StepEvent(run_id=run_id, step=10_000, loss=1.0).to_json()
    sent = send(producer, key, stray, partition=stray_partition).get(timeout=10)
    keyless = StepEvent(run_id=run_id, step=1, loss=1.0).to_json()
    unkeyed = producer.send(topics.TELEMETRY, key=None, value=keyless, partition=home).get(timeout=10)
    publish_fault_run(producer, run_id)

    assert_fault_found(broker.bootstrap, run_id)
    letters = {d.offset: d for d in deadletters(broker.bootstrap, key, 1)}  # (the keyless one has no key)
    assert letters[sent.offset].reason.startswith(f"partition: the record is on partition {stray_partition}")
    keyless_letters = [
        d
        for d in _deadletters_without_key(broker.bootstrap)
        if (d.partition, d.offset) == (unkeyed.partition, unkeyed.offset)
    ]
    assert [d.reason for d in keyless_letters] == ["key: missing (the record's key must be the run id)"]


def _deadletters_without_key(bootstrap: str) -> list:
    from runwatch.contract.schema import DeadLetter

    records = read_topic(bootstrap, topics.DEADLETTER, lambda rs: any(r.key is None for r in rs))
    return [DeadLetter.model_validate_json(r.value) for r in records if r.key is None]


# -- case 11: a run id that forges log lines --------------------------------------------------------


def test_case11_a_run_id_with_a_newline_is_deadlettered_and_forges_no_log_line(broker, unharmed, producer):  # noqa: F811
    marker = uuid.uuid4().hex
    forged = f"r\nERROR forged-{marker}"
    valid = run_on_partition_of(forged.encode(), "nl-valid")
    send(producer, forged.encode(), dumps(event(forged, step=1, loss=1.0))).get(timeout=10)
    publish_fault_run(producer, valid)

    assert_fault_found(broker.bootstrap, valid)
    (letter,) = deadletters(broker.bootstrap, forged.encode(), 1)
    assert letter.reason.startswith("limits: run_id: '\\n' at position 1"), letter.reason
    log = unharmed.log_path.read_text(errors="replace")
    assert not any(line.startswith(f"ERROR forged-{marker}") for line in log.splitlines())


# -- cases 2 and 3: a requeued job, and the stop of its earlier attempt ---------------------------

SCRIPT = Path(__file__).parents[1] / "support" / "fault_train.py"


def _attempt(
    bootstrap: str, public_keys: str, run_id: str, folder: Path, *args: str, env: dict | None = None
) -> subprocess.Popen:
    folder.mkdir(parents=True)
    # a fresh node: its own spool directory (and so its own record of applied actions)
    env = {
        **os.environ,
        **(env or {}),
        topics.PUBLIC_KEYS_ENV: public_keys,
        "RUNWATCH_SPOOL_DIR": str(folder / "spool"),
    }
    env.pop(topics.ATTEMPT_ENV, None)
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--bootstrap",
        bootstrap,
        "--run-id",
        run_id,
        "--out",
        str(folder),
        "--steps",
        "120",
        *args,
    ]
    with open(folder / "train.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(proc: subprocess.Popen, folder: Path, expect: int, timeout: float = 180) -> dict:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError((folder / "train.log").read_text()[-3000:]) from None
    assert code == expect, (folder / "train.log").read_text()[-3000:]
    return json.loads((folder / "result.json").read_text())


def test_cases2_and_3_a_requeued_attempt_is_watched_fresh_and_the_old_stop_is_not_applied(
    broker, action_keys, worker, tmp_path
):
    run_id = new_run("requeue")
    # Attempt 1: NaN from step 30 and no checkpoint to roll back to: a stop, and the job is killed
    # (no run_end), as a preempted job is.
    first = _attempt(
        broker.bootstrap,
        action_keys.public_text,
        run_id,
        tmp_path / "a1",
        "--fault",
        "nan:30",
        "--checkpoint-every",
        "1000",
        "--exit-on-stop",
        "kill",
    )
    one = _finish(first, tmp_path / "a1", expect=137)
    assert one["status"] == "stopped" and [a["kind"] for a in one["applied"]] == ["alert", "stop"]
    stopped_at = time.monotonic()
    # Attempt 2, within 30 s of the stop, same run id, a fresh spool directory: NaN at step 50 again.
    second = _attempt(
        broker.bootstrap,
        action_keys.public_text,
        run_id,
        tmp_path / "a2",
        "--fault",
        "nan:50",
        "--checkpoint-every",
        "10",
    )
    assert time.monotonic() - stopped_at < 30
    two = _finish(second, tmp_path / "a2", expect=0)

    kinds = [(a["kind"], a["outcome"]) for a in two["applied"]]
    assert ("stop", "applied") not in kinds, two["applied"]  # the old stop was not re-applied
    assert ("rollback", "applied") in kinds, two["applied"]  # the new attempt's NaN was acted on
    assert two["status"] == "completed" and two["ignored"].get("other_attempt", 0) >= 1, two
    issued = [
        a
        for a in (
            decode_action(r.value)
            for r in read_topic(
                broker.bootstrap, topics.ACTIONS, lambda rs: sum(r.key == run_id.encode() for r in rs) >= 4
            )
        )
        if a.run_id == run_id
    ]
    attempts = {a.kind: a.attempt for a in issued if a.kind in ("stop", "rollback")}
    assert attempts["stop"] and attempts["rollback"] and attempts["stop"] != attempts["rollback"]


def test_ranks_of_a_requeued_slurm_job_without_rank_sync_refuse_the_old_stop(
    broker, action_keys, worker, tmp_path
):
    """Issue 35, item 9: two ranks (two processes, no process group: no rank sync), fresh spool directories
    on requeue, no RUNWATCH_ATTEMPT; Slurm's job id and restart count name the attempt on every rank. Before,
    rank 1 named none and applied the first attempt's stop (a DDP job then hangs on rank 0)."""
    run_id = new_run("requeue-ranks")

    def ranks(attempt: int, *args: str) -> list[subprocess.Popen]:
        return [
            _attempt(
                broker.bootstrap,
                action_keys.public_text,
                run_id,
                tmp_path / f"a{attempt}-r{rank}",
                *args,
                env={
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "SLURM_JOB_ID": "4242",
                    "SLURM_RESTART_COUNT": str(attempt),
                },
            )
            for rank in (0, 1)
        ]

    first = ranks(0, "--fault", "nan:30", "--checkpoint-every", "1000", "--exit-on-stop", "kill")
    ones = [_finish(p, tmp_path / f"a0-r{r}", expect=137) for r, p in enumerate(first)]
    assert all(one["status"] == "stopped" for one in ones), ones
    stopped_at = time.monotonic()
    # (the NaN late enough that checkpoints are confirmed whatever the order the two ranks' first events
    # reach the worker in: a rank's steps sent before rank 0's run_start count for the old attempt)
    second = ranks(1, "--fault", "nan:100", "--checkpoint-every", "10", "--steps", "160")
    assert time.monotonic() - stopped_at < 30
    twos = [_finish(p, tmp_path / f"a1-r{r}", expect=0) for r, p in enumerate(second)]
    for rank, two in enumerate(twos):
        kinds = [(a["kind"], a["outcome"]) for a in two["applied"]]
        old_stop = [
            a for a in two["applied"] if a["kind"] == "stop" and "before step 30" in (a["detail"] or "")
        ]
        assert not old_stop and ("stop", "applied") not in kinds, (rank, two["applied"])
        assert ("rollback", "applied") in kinds, (rank, two["applied"])
        assert two["status"] == "completed" and two["ignored"].get("other_attempt", 0) >= 1, (rank, two)


# -- case 6: pointed at a broker or a database that is not there ----------------------------------


def test_case6_worker_sink_and_remediate_exit_with_one_line_when_nothing_answers(action_keys, tmp_path):
    nothing = f"127.0.0.1:{free_port()}"  # a free port: nobody listens
    config = tmp_path / "remediate.yaml"
    config.write_text("rules: []\nwebhooks: []\n")
    env = {**os.environ, **action_keys.worker_env, **action_keys.trainer_env, **STATE_KEY}
    env.pop(topics.BOOTSTRAP_ENV, None)
    cli = [sys.executable, "-m", "runwatch.cli"]
    commands = {
        "worker": [*cli, "worker", "--bootstrap", nothing, "--web-port", "0"],
        "sink": [*cli, "sink", "--bootstrap", nothing, "--dsn", f"chdb://{tmp_path / 'sink-db'}"],
        "remediate": [
            *cli,
            "remediate",
            "--bootstrap",
            nothing,
            "--config",
            str(config),
            "--dsn",
            f"chdb://{tmp_path / 'rem-db'}",
        ],
        "sink, no ClickHouse": [*cli, "sink", "--bootstrap", nothing, "--dsn", f"http://{nothing}"],
        "remediate, no ClickHouse": [
            *cli,
            "remediate",
            "--bootstrap",
            nothing,
            "--config",
            str(config),
            "--dsn",
            f"http://{nothing}",
        ],
    }
    started = time.monotonic()
    procs = {
        name: subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path, start_new_session=True
        )
        for name, cmd in commands.items()
    }
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=max(1.0, 45 - (time.monotonic() - started)))
            lines = [line for line in err.decode().splitlines() if line.strip()]
            assert proc.returncode == 2, (name, lines)
            assert len(lines) == 1, (name, lines)
            what = "ClickHouse" if "ClickHouse" in name else "the Kafka broker"
            assert lines[0].startswith(f"error: cannot reach {what} at"), (name, lines)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    # (all five ran at once on two cores; each alone ends in about 21 s)
    assert time.monotonic() - started < 45


# -- case 10: a trainer reads only what was issued since it started ------------------------------


def test_case10_a_new_listener_reads_no_other_runs_history(tmp_path, action_keys):
    from runwatch.producer.actions.reader import ActionReader

    broker = EmbeddedBroker(log_path=tmp_path / "broker.log").start()  # its own: the count is exact
    try:
        ensure_topics(broker.bootstrap)
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
        now = datetime.now(UTC)

        def signed(run_id: str) -> bytes:
            a = Action(
                action_id=uuid.uuid4().hex,
                run_id=run_id,
                kind="alert",
                reason="r",
                issued_at=now,
                expires_at=now + timedelta(minutes=5),
            )
            return sign_action(a, action_keys.signing).to_json()

        # other runs' history, on every partition, sent a minute before the trainer starts
        old_ms = int((now - timedelta(minutes=1)).timestamp() * 1000)
        for i in range(40):
            producer.send(
                topics.ACTIONS, key=f"other-{i}".encode(), value=signed(f"other-{i}"), timestamp_ms=old_ms
            )
        producer.flush(10)
        seen: list[bytes] = []
        reader = ActionReader(
            broker.bootstrap, topics.ACTIONS, datetime.now(UTC), seen.append, client_id="case10"
        )
        reader.start()
        try:
            assert reader.ready.wait(30)
            producer.send(topics.ACTIONS, key=b"mine", value=signed("mine")).get(timeout=10)
            eventually(lambda: seen, 20, "the action sent after the start")
            time.sleep(1.0)  # anything older would have come with it
            assert [decode_action(v).run_id for v in seen] == ["mine"]
        finally:
            reader.close()
            producer.close(timeout=5)
    finally:
        broker.stop()


# -- cases 8 and 9: the sink stores only what it can keep as sent, and only signed actions ----------


def test_cases8_and_9_the_sink_deadletters_rows_it_cannot_keep_and_actions_that_do_not_verify(
    broker, chdb_dsn, action_keys
):
    from runwatch.sinks import ClickHouseSink, SinkConsumer
    from tests.sinks.test_sink_poison import _running, _send, _sink_letters

    run_id = new_run("sinkcheck")
    key = run_id.encode()
    group = f"sink-field-{run_id}"
    now = datetime.now(UTC)
    old = datetime(1971, 3, 1, tzinfo=UTC)
    sink = ClickHouseSink(chdb_dsn)
    kafka = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)

    def action(kind: str, **update) -> Action:
        a = Action(
            action_id=uuid.uuid4().hex,
            run_id=run_id,
            kind=kind,
            reason="loss NaN",
            issued_at=now,
            expires_at=now + timedelta(minutes=2),
        )
        return sign_action(a, action_keys.signing).model_copy(update=update)

    try:
        sink.migrate()
        good = [StepEvent(run_id=run_id, step=s, loss=1.0).to_json() for s in range(3)]
        for raw in good:
            _send(kafka, topics.TELEMETRY, key, raw)
        # a 1971 ts sent with a 1971 record time: accepted by the time window, deleted at once by the TTL
        ancient = kafka.send(
            topics.TELEMETRY,
            key=key,
            value=StepEvent(run_id=run_id, step=3, ts=old).to_json(),
            timestamp_ms=int(old.timestamp() * 1000),
        ).get(timeout=30)
        signed = action("rollback")
        forged = action("stop", signature="0" * 64)
        tampered = sign_action(action("alert"), action_keys.signing).model_copy(update={"kind": "stop"})
        unsigned = action("stop", signature="")
        ahead = now + timedelta(hours=1)
        future = sign_action(
            action("stop").model_copy(update={"issued_at": ahead, "expires_at": ahead}), action_keys.signing
        )
        refused = {
            _send(kafka, topics.ACTIONS, key, a.to_json()): a.action_id
            for a in (forged, tampered, unsigned, future)
        }
        _send(kafka, topics.ACTIONS, key, signed.to_json())
        kafka.flush()
        consumer = SinkConsumer(
            sink, broker.bootstrap, group_id=group, batch_interval_s=0.2, public_keys=action_keys.public
        )
        with _running(consumer):
            eventually(lambda: len(_sink_letters(sink, run_id)) >= 5, 60, "the sink's dead letters")
            eventually(lambda: sink.runs.counts(run_id)["actions"] == 1, 30, "the signed action stored")
        letters = _sink_letters(sink, run_id)
        assert set(letters) == {
            (topics.TELEMETRY, ancient.partition, ancient.offset),
            *((topics.ACTIONS, p, o) for p, o in refused),
        }
        assert (
            "older than the telemetry table's 90-day retention"
            in letters[(topics.TELEMETRY, ancient.partition, ancient.offset)][0]
        )
        reasons = sorted(letters[(topics.ACTIONS, p, o)][0].split(":")[0] for p, o in refused)
        assert reasons == ["action bad_signature"] * 3 + ["action future"], reasons
        stored = sink.query(
            "SELECT action_id, kind FROM {db}.actions FINAL WHERE run_id = %(r)s", {"r": run_id}
        )
        assert stored == [(signed.action_id, "rollback")]
        assert sink.runs.counts(run_id)["telemetry"] == len(good)
    finally:
        kafka.close()
        sink.close()


def test_case6_the_health_port_answers_from_the_first_second_while_the_worker_starts(action_keys, tmp_path):
    import urllib.request

    nothing = f"127.0.0.1:{free_port()}"
    port = free_port()
    env = {**os.environ, **action_keys.worker_env, **STATE_KEY}
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runwatch.cli",
            "worker",
            "--bootstrap",
            nothing,
            "--web-port",
            str(port),
            "--web-host",
            "127.0.0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:

        def answer(path: str):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())
            except OSError:
                return None

        status, body = eventually(lambda: answer("/livez"), 10, "the health port to answer", interval=0.05)
        answered_s = time.monotonic() - started
        assert status == 200 and body["reason"].startswith("starting: "), body  # live: not to be killed
        eventually(
            lambda: answer("/livez")[1]["reason"] == f"starting: reaching the Kafka broker at {nothing}",
            10,
            "the endpoint to say what the worker waits for",
        )
        assert answer("/readyz")[0] == 503
        # (about 0.3 s on an idle machine; under two CPU hogs the interpreter's start alone takes longer)
        assert answered_s < 5, answered_s
        _, err = proc.communicate(timeout=45)
        assert proc.returncode == 2 and err.decode().strip().startswith(
            "error: cannot reach the Kafka broker"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
