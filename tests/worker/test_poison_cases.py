"""Issue 11's numbered poison cases 1-5, 7, 8 and 12, one regression test each, against the real
broker and the real session worker (cases 6, 9, 10 and 11 have theirs in test_sink_poison.py,
test_listener_poison.py, test_remediate_targets.py and test_non_python_client.py).

Every test sends its poison, then a valid run on the SAME telemetry partition whose known fault
(healthy steps, then NaN losses) must still be found: a ``non_finite`` anomaly, then an ``alert``
and a ``rollback`` action. And every test ends by checking that the worker neither crashed nor
restarted (same pid, same detector process, /livez 200).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from kafka import KafkaProducer
from kafka.partitioner.default import murmur2

from runwatch.contract import topics
from runwatch.contract.schema import (
    CheckpointEvent,
    DeadLetter,
    HeartbeatEvent,
    JoinedStep,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
    decode_action,
    decode_anomaly,
)
from runwatch.local.broker import committed_offset
from runwatch.local.worker_process import WorkerProcess
from tests.conftest import eventually, read_topic
from tests.support.action_keys import UNIT

pytestmark = pytest.mark.integration

NAN_STEPS = 3  # non_finite turns critical (rollback) after this many NaN steps in a row (the default)
HEALTHY_STEPS = 30  # before the NaNs: the checkpoint at step 5 is confirmed good 20 steps after it


# -- helpers ------------------------------------------------------------------------------------


def new_run(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def partition_of(key: bytes) -> int:
    """The telemetry partition kafka-python's default partitioner (murmur2) gives ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % topics.DEFAULT_PARTITIONS


def run_on_partition_of(key: bytes, prefix: str) -> str:
    """A fresh run id whose events land on the same telemetry partition as ``key``'s."""
    want = partition_of(key)
    while True:
        run_id = new_run(prefix)
        if partition_of(run_id.encode()) == want:
            return run_id


def event(run_id: str, kind: str = "step", **fields) -> dict:
    """A telemetry event with every required field, as a dict to spoil; ``fields`` override."""
    body = {
        "schema_version": 1,
        "event_id": uuid.uuid4().hex,
        "run_id": run_id,
        "rank": 0,
        "ts": datetime.now(UTC).isoformat(),
        "kind": kind,
    }
    if kind == "step":
        body["step"] = 1
    body.update(fields)
    return body


def dumps(body: dict) -> bytes:
    # stdlib json: writes Infinity, integers of any size, anything a careless client could send
    return json.dumps(body).encode()


def without(body: dict, name: str) -> dict:
    return {k: v for k, v in body.items() if k != name}


@pytest.fixture
def producer(broker) -> Iterator[KafkaProducer]:
    p = KafkaProducer(
        bootstrap_servers=broker.bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        max_request_size=4 * 1024 * 1024,
    )
    try:
        yield p
    finally:
        p.close(timeout=10)


@pytest.fixture
def unharmed(worker) -> Iterator[WorkerProcess]:
    """The session worker, checked after the test: not crashed, not restarted, still live."""

    def answering():
        # (the ready file is written when partitions are assigned, which may be before the endpoint listens)
        try:
            status, health = worker.health()
        except OSError:
            return None
        return status == 200 and health

    before = eventually(answering, 30, "the worker's health endpoint to answer 200", interval=0.2)
    detector_pid = before["detector_process"]["pid"]
    yield worker
    assert worker.process.poll() is None, (
        f"the worker exited with {worker.process.returncode}; see {worker.log_path}"
    )
    status, after = worker.health()
    assert status == 200 and after["live"], after
    assert after["pid"] == worker.process.pid == before["pid"]
    assert after["detector_process"]["pid"] == detector_pid and after["detector_process"]["alive"]
    assert worker.health("/livez")[0] == 200


def send(producer: KafkaProducer, key: bytes, value: bytes | None, **kwargs):
    return producer.send(topics.TELEMETRY, key=key, value=value, **kwargs)


def publish_fault_run(producer: KafkaProducer, run_id: str, ranks: int = 1, healthy: int = HEALTHY_STEPS):
    """A valid run of ``ranks`` ranks: ``healthy`` steps with a checkpoint at step 5 (confirmed good
    20 steps later), then NaN losses until the rollback threshold, then its end. Returns its last
    record's metadata (partition, offset)."""
    key = run_id.encode()
    futures = []

    def each_rank(make) -> None:
        futures.extend(send(producer, key, make(rank).to_json()) for rank in range(ranks))

    each_rank(lambda r: RunStartEvent(run_id=run_id, rank=r, world_size=ranks))
    for step in range(1, healthy + 1):
        each_rank(lambda r, s=step: StepEvent(run_id=run_id, rank=r, step=s, loss=1.0, grad_norm=1.0))
        if step == 5:
            each_rank(lambda r, s=step: CheckpointEvent(run_id=run_id, rank=r, step=s, uri=f"/ckpt/{s}.pt"))
    for step in range(healthy + 1, healthy + 1 + NAN_STEPS):
        each_rank(lambda r, s=step: StepEvent(run_id=run_id, rank=r, step=s, loss=math.nan))
    each_rank(lambda r: RunEndEvent(run_id=run_id, rank=r, status="stopped"))
    producer.flush()
    assert len({f.get(timeout=10).partition for f in futures}) == 1
    return futures[-1].get()


def actions_of(bootstrap: str, run_id: str, timeout: float = 30.0) -> list[str]:
    key = run_id.encode()

    def kinds(records):
        return [decode_action(r.value).kind for r in records if r.key == key]

    return kinds(
        read_topic(bootstrap, topics.ACTIONS, lambda rs: {"rollback", "stop"} & set(kinds(rs)), timeout)
    )


def anomalies_of(bootstrap: str, run_id: str, until, timeout: float = 30.0) -> list:
    key = run_id.encode()

    def ours(records):
        return [decode_anomaly(r.value) for r in records if r.key == key]

    return ours(read_topic(bootstrap, topics.ANOMALIES, lambda rs: until(ours(rs)), timeout))


def has_critical_non_finite(anomalies: list) -> bool:
    return any(a.detector == "non_finite" and a.severity == "critical" for a in anomalies)


def assert_fault_found(bootstrap: str, run_id: str) -> None:
    """The valid run's NaN losses were found and acted on: an alert, then a rollback."""
    assert actions_of(bootstrap, run_id) == ["alert", "rollback"]
    found = anomalies_of(bootstrap, run_id, has_critical_non_finite)
    assert {a.detector for a in found} == {"non_finite"}


def deadletters(bootstrap: str, key: bytes, count: int, timeout: float = 30.0) -> list[DeadLetter]:
    """The dead letters keyed ``key``: waits for ``count`` of them, and asserts there are no more."""

    def ours(records):
        return [DeadLetter.model_validate_json(r.value) for r in records if r.key == key]

    letters = ours(read_topic(bootstrap, topics.DEADLETTER, lambda rs: len(ours(rs)) >= count, timeout))
    assert len(letters) == count, [d.reason for d in letters]
    return letters


def wait_committed_past(bootstrap: str, partition: int, offset: int, timeout: float = 30.0) -> None:
    eventually(
        lambda: committed_offset(bootstrap, topics.DETECT_GROUP, topics.TELEMETRY, partition) > offset,
        timeout,
        f"the worker's group to commit past {topics.TELEMETRY}[{partition}]@{offset}",
        interval=0.25,
    )


# -- case 1: a null value ------------------------------------------------------------------------


def test_case1_a_tombstone_is_deadlettered_and_committed_past(broker, unharmed, producer):
    run_id = new_run("tomb")
    key = run_id.encode()
    tombstone = send(producer, key, None).get(timeout=10)
    valid = run_on_partition_of(key, "tomb-valid")
    assert publish_fault_run(producer, valid).partition == tombstone.partition

    assert_fault_found(broker.bootstrap, valid)
    (letter,) = deadletters(broker.bootstrap, key, 1)
    assert "null" in letter.reason and letter.stage == "decode"
    assert letter.size == 0 and letter.raw == "" and not letter.raw_truncated and letter.sha256 is None
    assert (letter.partition, letter.offset, letter.key) == (tombstone.partition, tombstone.offset, run_id)
    wait_committed_past(broker.bootstrap, tombstone.partition, tombstone.offset)


# -- case 2: a time without a timezone -----------------------------------------------------------


def test_case2_a_ts_without_timezone_is_deadlettered(broker, unharmed, producer):
    run_id = new_run("naive")
    key = run_id.encode()
    bad = [
        dumps(event(run_id, ts="2026-11-21T09:30:00")),
        dumps(event(run_id, ts="2026-11-21")),
        dumps(event(run_id, "heartbeat", ts="2026-11-21T09:30:00", interval_s=0.5)),
    ]
    partitions = {send(producer, key, raw).get(timeout=10).partition for raw in bad}
    valid = run_on_partition_of(key, "naive-valid")
    assert {publish_fault_run(producer, valid).partition} == partitions

    assert_fault_found(broker.bootstrap, valid)
    letters = deadletters(broker.bootstrap, key, len(bad))
    assert sorted(d.raw for d in letters) == sorted(raw.decode() for raw in bad)
    for letter in letters:
        assert "ts" in letter.reason and "timezone" in letter.reason, letter.reason


# -- case 3: a malformed message of a megabyte and more ------------------------------------------


def test_case3_a_megabyte_of_garbage_gets_a_bounded_deadletter_and_never_wedges(broker, unharmed, producer):
    run_id = new_run("huge")
    key = run_id.encode()
    rng = random.Random(3)
    bad = [
        b"not json " * 111_111 + b"x",  # 1,000,000 bytes, printable
        b"\xff" + rng.randbytes(1_199_999),
    ]  # 1.2 MB, random bytes: over the 1 MiB message limit too
    assert [len(b) for b in bad] == [1_000_000, 1_200_000]
    sent = [send(producer, key, raw).get(timeout=30) for raw in bad]
    valid = run_on_partition_of(key, "huge-valid")
    assert publish_fault_run(producer, valid).partition == sent[0].partition == sent[1].partition

    assert_fault_found(broker.bootstrap, valid)  # the alert AND the rollback, after the big ones

    def ours(records):
        return [r for r in records if r.key == key]

    records = ours(read_topic(broker.bootstrap, topics.DEADLETTER, lambda rs: len(ours(rs)) >= 2))
    assert len(records) == 2
    by_offset = {}
    for record in records:
        assert len(record.value) < 16 * 1024, len(record.value)
        letter = DeadLetter.model_validate_json(record.value)
        by_offset[letter.offset] = letter
    assert sorted(by_offset) == [m.offset for m in sent]
    for raw, meta in zip(bad, sent, strict=True):
        letter = by_offset[meta.offset]
        assert letter.raw_truncated and letter.size == len(raw)
        assert letter.sha256 == hashlib.sha256(raw).hexdigest()
        assert letter.raw == raw[:4096].decode(errors="replace")
    assert by_offset[sent[0].offset].reason.startswith("not JSON")
    assert "1200000 bytes" in by_offset[sent[1].offset].reason
    wait_committed_past(broker.bootstrap, sent[1].partition, sent[1].offset)


# -- case 4: no bound on rank / world_size --------------------------------------------------------


def test_case4_huge_rank_and_world_size_are_deadlettered_and_timers_keep_working(broker, unharmed, producer):
    run_id = new_run("rank")
    key = run_id.encode()
    _, before = unharmed.health()
    bad = [
        dumps(event(run_id, "run_start", rank=10**6)),
        dumps(event(run_id, "run_start", rank=10**7)),
        dumps(event(run_id, "run_start", world_size=10**7)),
        dumps(event(run_id, "step", rank=10**6, step=1, loss=1.0)),
        dumps(event(run_id, "step", rank=10**7, step=1, loss=1.0)),
    ]
    for raw in bad:
        send(producer, key, raw)
    # The same run, valid from here on, with two ranks: had a rank of 10^6 or a world size of 10^7
    # been taken, its joined steps would wait for, and list, a million missing ranks.
    last = publish_fault_run(producer, run_id, ranks=2)

    assert_fault_found(broker.bootstrap, run_id)
    letters = deadletters(broker.bootstrap, key, len(bad))
    assert sorted(d.raw for d in letters) == sorted(raw.decode() for raw in bad)
    for letter in letters:
        field = "world_size" if '"world_size"' in letter.raw else "rank"
        assert field in letter.reason, letter.reason

    steps = HEALTHY_STEPS + NAN_STEPS

    def ours(records):
        return [r for r in records if r.key == key]

    joined = ours(read_topic(broker.bootstrap, topics.JOINED, lambda rs: len(ours(rs)) >= steps))
    assert len(joined) == steps
    assert max(len(r.value) for r in joined) < 4096, [len(r.value) for r in joined]
    for r in joined:
        j = JoinedStep.model_validate_json(r.value)
        assert j.complete and j.world_size == 2 and j.ranks_reported == [0, 1] and j.ranks_missing == []

    # The timers keep ticking for everyone: the detector process answers at once, goes on processing,
    # and its tick (the only place that counts the runs held) sees a new run come and go.
    wait_committed_past(broker.bootstrap, last.partition, last.offset)  # the run's end is processed,
    time.sleep(0.5)  # and a tick or two has counted it out
    held = unharmed.health()[1]["counters"]["runs"]
    ticker = new_run("rank-ticker")
    send(producer, ticker.encode(), RunStartEvent(run_id=ticker).to_json())
    send(producer, ticker.encode(), HeartbeatEvent(run_id=ticker, step=0, interval_s=0.5).to_json())
    producer.flush()

    def counters():
        status, health = unharmed.health()
        assert status == 200, health
        assert health["detector_process"]["oldest_pending_s"] < 2.0, health["detector_process"]
        return health["counters"]

    eventually(lambda: counters()["runs"] == held + 1, 10, "a tick to count the new run")
    send(producer, ticker.encode(), RunEndEvent(run_id=ticker).to_json())
    producer.flush()
    eventually(lambda: counters()["runs"] == held, 10, "a tick to count the ended run out")
    after = counters()
    assert after["processed"] > before["counters"]["processed"]
    assert after["deadlettered"] >= before["counters"]["deadlettered"] + len(bad)


# -- case 5: a time in the year 9999 -------------------------------------------------------------


def test_case5_a_ts_in_year_9999_is_deadlettered_and_the_timer_keeps_ticking(broker, unharmed, producer):
    run_id = new_run("y9999")
    key = run_id.encode()
    started = time.monotonic()
    bad = [
        dumps(event(run_id, ts="9999-12-31T00:00:00Z")),
        dumps(event(run_id, "heartbeat", ts="9999-12-31T00:00:00Z", interval_s=0.5)),
    ]
    partitions = {send(producer, key, raw).get(timeout=10).partition for raw in bad}
    valid = run_on_partition_of(key, "y9999-valid")
    assert {publish_fault_run(producer, valid).partition} == partitions

    assert_fault_found(broker.bootstrap, valid)
    letters = deadletters(broker.bootstrap, key, len(bad))
    for letter in letters:
        assert letter.reason.startswith("limits: ts:") and "9999-12-31" in letter.reason, letter.reason
    time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))  # ticks every 0.25 s: a few of them since
    assert unharmed.process.poll() is None and unharmed.health("/livez")[0] == 200


# -- case 7: one bad value poisons a run's liveness ----------------------------------------------


def test_case7_one_skewed_time_or_interval_does_not_make_live_ranks_silent(broker, unharmed, producer):
    run_id = new_run("live")
    key = run_id.encode()
    ranks = (0, 1)

    def beat(step: int) -> None:
        for rank in ranks:
            send(producer, key, HeartbeatEvent(run_id=run_id, rank=rank, step=step, interval_s=0.5).to_json())
            send(
                producer,
                key,
                StepEvent(run_id=run_id, rank=rank, step=step, loss=1.0, grad_norm=1.0).to_json(),
            )
        producer.flush()

    for rank in ranks:
        send(producer, key, RunStartEvent(run_id=run_id, rank=rank, world_size=2).to_json())
    bad = [
        dumps(event(run_id, step=4, ts="2099-06-01T00:00:00+00:00")),
        dumps(event(run_id, "heartbeat", rank=1, step=4, interval_s="Infinity")),  # the wire's infinity
        dumps(event(run_id, "heartbeat", rank=1, step=4, interval_s=1e12)),
    ]
    step, poisoned_at = 0, None
    # A live run: heartbeats and steps of both ranks every 0.5 s; the poison at step 4, then ~5 s
    # more of the run, which must not find any rank silent.
    while poisoned_at is None or time.monotonic() - poisoned_at < 5.0:
        step += 1
        beat(step)
        if step == 4:
            for raw in bad:
                send(producer, key, raw)
            # Valid but 200 s ahead (inside the 300 s window): the run's clock must not follow it.
            ahead = datetime.now(UTC) + timedelta(seconds=200)
            send(
                producer,
                key,
                HeartbeatEvent(run_id=run_id, rank=0, step=step, interval_s=0.5, ts=ahead).to_json(),
            )
            producer.flush()
            poisoned_at = time.monotonic()
        time.sleep(0.5)
    for nan_step in range(step + 1, step + 1 + NAN_STEPS):
        for rank in ranks:
            send(producer, key, StepEvent(run_id=run_id, rank=rank, step=nan_step, loss=math.nan).to_json())
    for rank in ranks:
        send(producer, key, RunEndEvent(run_id=run_id, rank=rank, status="stopped").to_json())
    producer.flush()

    assert actions_of(broker.bootstrap, run_id) == ["alert", "stop"]  # no checkpoint to roll back to
    anomalies = anomalies_of(broker.bootstrap, run_id, has_critical_non_finite)
    silent = [a for a in anomalies if a.detector == "stall" and a.evidence.get("kind") == "silent"]
    assert silent == [], [a.message for a in silent]
    letters = {d.raw: d.reason for d in deadletters(broker.bootstrap, key, len(bad))}
    assert set(letters) == {raw.decode() for raw in bad}
    assert letters[bad[0].decode()].startswith("limits: ts:") and "2099" in letters[bad[0].decode()]
    for raw in bad[1:]:
        assert "interval_s" in letters[raw.decode()], letters[raw.decode()]


# -- case 8: validation as strict as documented ---------------------------------------------------


def test_case8_every_loose_message_is_deadlettered_naming_its_field(broker, unharmed, producer):
    run_id = new_run("strict")
    key = run_id.encode()
    e = event(run_id, step=5, loss=1.0)
    cases = {  # name -> (message, what its reason must name)
        "missing event_id": (without(e, "event_id"), "event_id"),
        "missing rank": (without(e, "rank"), "rank"),
        "missing ts": (without(e, "ts"), "ts"),
        "missing schema_version": (without(e, "schema_version"), "schema_version"),
        "step as text": ({**e, "step": "5"}, "step"),
        "step as float": ({**e, "step": 2.0}, "step"),
        "step as bool": ({**e, "step": True}, "step"),
        "ts as a number": ({**e, "ts": 12345}, "ts"),
        "schema_version 0": ({**e, "schema_version": 0}, "schema_version"),
        "schema_version 2": ({**e, "schema_version": 2}, "schema_version"),
        "negative memory": ({**e, "memory": {"allocated": -1}}, "memory.allocated"),
        "negative step time": ({**e, "step_time_s": -0.5}, "step_time_s"),
    }
    # every message unique (its raw bytes identify its dead letter)
    sent = {
        dumps({**body, "event_id": name} if "event_id" in body else body): (name, field)
        for name, (body, field) in cases.items()
    }
    assert len(sent) == len(cases)
    partitions = {send(producer, key, raw).get(timeout=10).partition for raw in sent}
    valid = run_on_partition_of(key, "strict-valid")
    assert {publish_fault_run(producer, valid).partition} == partitions

    assert_fault_found(broker.bootstrap, valid)
    letters = deadletters(broker.bootstrap, key, len(sent))
    by_raw = {d.raw: d for d in letters}
    assert set(by_raw) == {raw.decode() for raw in sent}
    for raw, (name, field) in sent.items():
        reason = by_raw[raw.decode()].reason
        named = f"missing required field(s) {field}" if name.startswith("missing") else f"{field}:"
        assert named in reason, f"{name}: {reason}"
        assert by_raw[raw.decode()].stage == "decode"


# -- case 12: a signing key that is not one is refused; the health endpoint listens ---------------


def test_case12_a_signing_key_that_is_not_one_is_refused_and_the_health_endpoint_answers(
    broker, unharmed, tmp_path
):
    # a public key where the private one belongs (the old one-character secret's case, for the new key)
    env = {**os.environ, topics.SIGNING_KEY_ENV: UNIT.public_text}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runwatch.cli",
            "worker",
            "--bootstrap",
            broker.bootstrap,
            "--web-port",
            "0",
            "--ready-file",
            str(tmp_path / "ready"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "RUNWATCH_ACTION_SIGNING_KEY holds a public key" in output, output
    assert not (tmp_path / "ready").exists()

    assert unharmed.health("/livez")[0] == 200
    assert unharmed.health("/readyz")[0] == 200
    status, health = unharmed.health("/health")
    assert status == 200 and health["live"] and health["ready"]
    assert health["partitions"] and any(p.startswith(f"{topics.TELEMETRY}:") for p in health["partitions"])
    assert health["detector_process"]["alive"] and health["detector_process"]["ready"]
