"""The examples of docs/publishing-without-python.md, run as they stand against the embedded broker.

The Node.js/kafkajs block publishes a run that the worker processes (a NaN loss becomes a
non_finite anomaly), on the partition kafka-python chooses for its run id; its publisher puts
200 fresh run ids where kafka-python puts them. The kcat block works where kcat is built on
librdkafka 2.2.0 or newer, and fails as documented on an older one (Debian 12's 2.0.2).

The clients are installed by `make clients` (part of `make test`). A missing one fails the test in
CI and skips it elsewhere.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic

from runwatch.contract import topics
from runwatch.contract.schema import REQUIRED_FIELDS, decode_anomaly, decode_event
from tests.conftest import read_topic

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "publishing-without-python.md"
NODE_MODULES = ROOT / ".runwatch" / "clients" / "node_modules"
NODE_MARKER = "<!-- executed by tests/contract/test_non_python_client.py -->"
KCAT_MARKER = "<!-- kcat: executed by tests/contract/test_non_python_client.py -->"
# The documented event's variables: the tests put their own run id, step and loss in this line.
EVENT_LINE = "RUN_ID=run-42 RANK=0 STEP=1 LOSS=2.5"
KCAT_FAILURE = "ApiVersionRequest failed: Local: Read underflow"


def doc_block(marker: str) -> str:
    match = re.search(re.escape(marker) + r"\n```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    assert match, f"{DOC.name}: no ```sh block after {marker!r}"
    return match.group(1)


def with_event(block: str, run_id: str, step: int, loss: str) -> str:
    assert block.count(EVENT_LINE) == 1 and block.count("run-42") == 1, f"{DOC.name} changed: {EVENT_LINE!r}"
    return block.replace(EVENT_LINE, f"RUN_ID={run_id} RANK=0 STEP={step} LOSS={shlex.quote(loss)}")


def require_client(what: str, present: bool) -> None:
    if present:
        return
    message = f"{what} is missing: run `make clients` (as root it installs it; `make test` does)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def node_env() -> dict[str, str]:
    require_client("node (Node.js)", shutil.which("node") is not None)
    require_client(f"kafkajs under {NODE_MODULES}", (NODE_MODULES / "kafkajs" / "package.json").is_file())
    return {**os.environ, "NODE_PATH": str(NODE_MODULES)}


def run_sh(script: str, cwd: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def python_partitions(bootstrap: str, keys: list[str], partitions: int) -> dict[str, int]:
    """Where kafka-python's KafkaProducer (its DefaultPartitioner) puts each key, on a fresh topic."""
    topic = new_topic(bootstrap, partitions)
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        futures = {key: producer.send(topic, key=key.encode(), value=b"{}") for key in keys}
        producer.flush()
        return {key: f.get(10).partition for key, f in futures.items()}
    finally:
        producer.close()


def new_topic(bootstrap: str, partitions: int) -> str:
    name = f"client-check-{partitions}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()
    return name


def telemetry_partitions(bootstrap: str) -> int:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        (meta,) = admin.describe_topics([topics.TELEMETRY])
        return len(meta["partitions"])
    finally:
        admin.close()


def check_event(record, run_id: str) -> None:
    """The record is a valid event by the strict decoder, with every required field and a current ts."""
    import orjson

    data = orjson.loads(record.value)
    assert set(REQUIRED_FIELDS) <= data.keys() and "step" in data, data
    event = decode_event(record.value)
    assert event.run_id == run_id == record.key.decode() and event.kind == "step" and event.rank == 0
    sent = datetime.fromtimestamp(record.timestamp / 1000, UTC)
    assert event.ts.tzinfo is not None and abs((event.ts - sent).total_seconds()) < 60


def test_documented_node_example_publishes_a_run_the_worker_processes(broker, worker, tmp_path, node_env):
    block = doc_block(NODE_MARKER)
    env = {**node_env, topics.BOOTSTRAP_ENV: broker.bootstrap}
    env.pop("RUNWATCH_TOPIC", None)
    run_id = f"node-{uuid.uuid4().hex[:8]}"
    # 30 healthy steps, then a NaN loss, each published by the documented block as it stands.
    reported = set()
    for step in range(1, 32):
        done = run_sh(with_event(block, run_id, step, '"NaN"' if step == 31 else "2.5"), tmp_path, env)
        assert done.returncode == 0, f"step {step}: {done.stderr}"
        match = re.fullmatch(rf"{re.escape(topics.TELEMETRY)} partition (\d+) base offset \d+\n", done.stdout)
        assert match, done.stdout
        reported.add(int(match.group(1)))

    key = run_id.encode()
    records = [
        r
        for r in read_topic(
            broker.bootstrap, topics.TELEMETRY, lambda rs: sum(r.key == key for r in rs) >= 31
        )
        if r.key == key
    ]
    assert len(records) == 31
    for record in records:
        check_event(record, run_id)
    expected = python_partitions(broker.bootstrap, [run_id], telemetry_partitions(broker.bootstrap))[run_id]
    assert {r.partition for r in records} == reported == {expected}

    def found(rs):
        return [
            a for a in (decode_anomaly(r.value) for r in rs if r.key == key) if a.detector == "non_finite"
        ]

    anomalies = found(read_topic(broker.bootstrap, topics.ANOMALIES, lambda rs: bool(found(rs)), timeout=60))
    assert anomalies[0].step == 31 and anomalies[0].run_id == run_id


@pytest.mark.parametrize("partitions", [4, 7])
def test_documented_publisher_partitions_runs_like_kafka_python(broker, tmp_path, node_env, partitions):
    topic = new_topic(broker.bootstrap, partitions)
    env = {**node_env, topics.BOOTSTRAP_ENV: broker.bootstrap, "RUNWATCH_TOPIC": topic}
    first = f"node-{uuid.uuid4().hex[:8]}"
    # writes runwatch-publish.js
    done = run_sh(with_event(doc_block(NODE_MARKER), first, 1, "2.5"), tmp_path, env)
    assert done.returncode == 0, done.stderr
    keys = [first] + [f"run-{uuid.uuid4().hex[:10]}" for _ in range(199)]
    lines = "".join(f"{key}|{{}}\n" for key in keys[1:])
    done = subprocess.run(
        ["node", "runwatch-publish.js"],
        input=lines,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr

    wanted = {key.encode() for key in keys}
    records = read_topic(broker.bootstrap, topic, lambda rs: len({r.key for r in rs} & wanted) == len(keys))
    by_node = {r.key.decode(): r.partition for r in records}
    by_python = python_partitions(broker.bootstrap, keys, partitions)
    differ = {k: (by_node[k], by_python[k]) for k in keys if by_node[k] != by_python[k]}
    assert not differ, f"{len(differ)}/{len(keys)} run ids on another partition than kafka-python's: {differ}"
    assert len(set(by_python.values())) == partitions  # the check covered every partition


def librdkafka_version(kcat: str) -> tuple[int, ...]:
    out = subprocess.run([kcat, "-V"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"librdkafka (\d+)\.(\d+)\.(\d+)", out)
    assert match, out
    return tuple(int(x) for x in match.groups())


def test_documented_kcat_example_works_or_fails_as_documented(broker, tmp_path):
    kcat = shutil.which("kcat")
    require_client("kcat", kcat is not None)
    version = librdkafka_version(kcat)
    run_id = f"kcat-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, topics.BOOTSTRAP_ENV: broker.bootstrap}
    done = run_sh(with_event(doc_block(KCAT_MARKER), run_id, 1, "2.5"), tmp_path, env, timeout=30)
    if version < (2, 2, 0):
        # Debian 12's kcat: the documented failure, word for word (if this starts passing, the doc is stale).
        assert done.returncode != 0 and KCAT_FAILURE in done.stderr, (done.returncode, done.stderr)
        return
    assert done.returncode == 0, done.stderr
    key = run_id.encode()
    (record,) = [
        r
        for r in read_topic(broker.bootstrap, topics.TELEMETRY, lambda rs: any(r.key == key for r in rs))
        if r.key == key
    ]
    check_event(record, run_id)
    expected = python_partitions(broker.bootstrap, [run_id], telemetry_partitions(broker.bootstrap))[run_id]
    assert record.partition == expected
