"""A state record that would run code in the worker does not (issue 35): on a real broker, records are
written to ``runwatch.state`` for three runs before a real worker starts, each a pickle that calls
``os.system("touch MARKER")``: one signed with the actions' public key (what every trainer holds), one with no
key (a trainer's environment has no state key), and one with the workers' own state key (a leaked key:
the unpickler is the second wall). The worker starts, refuses all three (counted, each logged with its
partition and offset), runs those runs fresh (their NaN streaks are found), and no marker appears."""

from __future__ import annotations

import os
import re
import secrets
from datetime import timedelta

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import Anomaly, RunStartEvent, StepEvent, utc_now
from runwatch.detectors.config import RunwatchConfig
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from runwatch.worker.state.snapshot import STATE_SECRET_ENV, SnapshotHeader, config_digest, encode_snapshot
from tests.conftest import eventually, read_topic

pytestmark = pytest.mark.integration

GROUP = "runwatch-poison-test"
NAN_FROM = 30
STEPS = 40


class RunsCode:
    """A hostile trainer's state record body: unpickling it calls ``os.system``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_state_record_that_would_run_code_is_refused_and_its_run_is_watched_fresh(tmp_path, action_keys):
    state_key = secrets.token_hex(32)
    trainer_env = {**os.environ, **action_keys.trainer_env}  # what the tests' trainers are given
    assert STATE_SECRET_ENV not in trainer_env  # a trainer has no state key to sign with
    keys = {
        "by-trainer-key": trainer_env[topics.PUBLIC_KEYS_ENV].encode(),
        "by-no-key": b"",
        "by-leaked-state-key": state_key.encode(),
    }
    markers = {run: tmp_path / f"MARKER-{run}" for run in keys}
    partitions = topics.DEFAULT_PARTITIONS
    config_sha = config_digest(RunwatchConfig().model_dump_json())  # the worker's (no --config)
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        producer = KafkaProducer(
            bootstrap_servers=broker.bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            max_request_size=topics.STATE_MAX_BYTES,
        )
        where = {}
        for run_id, key in keys.items():
            partition = topics.key_partition(run_id.encode(), partitions)
            header = SnapshotHeader(
                run_id=run_id,
                partition=partition,
                offset=-1,
                events=1,
                taken_at=utc_now(),
                config_sha=config_sha,
            )
            value = encode_snapshot(header, RunsCode(f"touch {markers[run_id]}"), key)
            meta = producer.send(
                topics.STATE, key=f"{GROUP}/{run_id}".encode(), value=value, partition=partition
            ).get(30)
            where[run_id] = (meta.partition, meta.offset)
        producer.flush(30)

        worker = WorkerProcess(
            broker.bootstrap,
            action_keys.signing,
            tmp_path / "worker.log",
            group=GROUP,
            state_secret=state_key,
        )
        try:
            worker.wait_ready(90)
            t0 = utc_now() - timedelta(minutes=5)
            for run_id in keys:
                events = [RunStartEvent(run_id=run_id, ts=t0, event_id=f"{run_id}-start")] + [
                    StepEvent(
                        run_id=run_id,
                        step=s,
                        ts=t0 + timedelta(seconds=s + 1),
                        loss=float("nan") if s >= NAN_FROM else 2.0 - 0.01 * s,
                    )
                    for s in range(STEPS)
                ]
                for event in events:
                    producer.send(topics.TELEMETRY, key=run_id.encode(), value=event.to_json())
            producer.flush(30)

            def found(records: list) -> bool:
                runs = {
                    r.key.decode()
                    for r in records
                    if Anomaly.model_validate_json(r.value).detector == "non_finite"
                }
                return set(keys) <= runs

            anomalies = [
                Anomaly.model_validate_json(r.value)
                for r in read_topic(broker.bootstrap, topics.ANOMALIES, found, timeout=90)
            ]

            def counted() -> dict | None:
                counters = worker.health()[1]["counters"]
                return counters if counters["processed"] >= len(keys) * (STEPS + 1) else None

            counters = eventually(counted, 30, "the worker's counters to cover every event")
        finally:
            worker.stop()
            producer.close()
        log = (tmp_path / "worker.log").read_text()

    # every run was judged afresh: its NaN streak found at its first NaN, by its own new detectors
    for run_id in keys:
        nan = [a for a in anomalies if a.run_id == run_id and a.detector == "non_finite"]
        assert nan and min(a.step for a in nan) == NAN_FROM, (run_id, nan)
    assert counters["restore_failures"] == 3 and counters["restored_runs"] == 0, counters
    # each refusal said where the record is, and why
    for run_id, (partition, offset) in where.items():
        record = rf"runwatch\.state\[{partition}\]@{offset}"
        line = re.search(rf"run {run_id}: its state record {record} cannot be read \((.*)\)", log)
        assert line, (run_id, log[-3000:])
        why = line.group(1)
        assert ("posix.system" in why) if run_id == "by-leaked-state-key" else ("not signed" in why), why
    # and nothing ran
    assert not [m for m in markers.values() if m.exists()]
