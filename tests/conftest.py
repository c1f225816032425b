"""The suite's shared parts. Real parts for integration tests: a Tansu broker process, a Faust worker
process, the embedded ClickHouse engine; every process is stopped by pid at the end. And, suite-wide: a
RunWatch that cannot reach its broker spools to disk under $RUNWATCH_SPOOL_DIR (default ./.runwatch/spool),
pointed at a temporary directory so tests never leave spools in the working tree, nor replay one left by an
earlier test run."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from runwatch.contract import topics
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from runwatch.producer.publish.kafka_delivery import SPOOL_DIR_ENV

if TYPE_CHECKING:
    from tests.support.service_process import Sandbox
from tests.support.action_keys import ActionKeys


@pytest.fixture(scope="session")
def broker(tmp_path_factory) -> Iterator[EmbeddedBroker]:
    b = EmbeddedBroker(log_path=tmp_path_factory.mktemp("broker") / "broker.log").start()
    try:
        ensure_topics(b.bootstrap)
        yield b
    finally:
        b.stop()


@pytest.fixture
def own_broker(tmp_path) -> Iterator[EmbeddedBroker]:
    """A broker of the test's own, with runwatch's topics: for a test that floods the topics (thousands of
    runs, hundreds of state records), which every later worker of the default group on the session broker
    would otherwise have to read and restore."""
    with EmbeddedBroker(log_path=tmp_path / "own-broker.log") as b:
        ensure_topics(b.bootstrap)
        yield b


@pytest.fixture(scope="session")
def action_keys() -> ActionKeys:
    """The session's action keys: the workers sign with ``action_keys.signing``; trainers, the sink and the
    remediator are given ``action_keys.public_text`` (``trainer_env``), which cannot sign."""
    return ActionKeys.generate()


@contextlib.contextmanager
def worker_with_config(
    broker: EmbeddedBroker,
    action_keys: ActionKeys,
    folder: Path,
    config: dict,
    group: str,
    extra_args: tuple[str, ...] = (),
) -> Iterator[WorkerProcess]:
    """A worker of its own consumer group running ``config`` (the session's default-config worker
    may be running too), stopped by its pid at the end."""
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    w = WorkerProcess(
        broker.bootstrap, action_keys.signing, folder / "worker.log", path, group=group, extra_args=extra_args
    )
    try:
        w.wait_ready(90)
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="session")
def worker(broker, action_keys, tmp_path_factory) -> Iterator[WorkerProcess]:
    w = WorkerProcess(broker.bootstrap, action_keys.signing, tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        w.wait_ready(90)
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="session")
def chdb_dsn(tmp_path_factory) -> str:
    # One embedded engine path per process (a chdb rule), shared by every test here.
    return f"chdb://{tmp_path_factory.mktemp('clickhouse')}"


def eventually(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_topic(bootstrap: str, topic: str, until: Callable[[list], bool], timeout: float = 30.0) -> list:
    """Every record of ``topic`` from the beginning, polled until ``until(records)`` holds."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, fetch_max_wait_ms=50
    )
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        records: list = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=100).values():
                records.extend(batch)
            if until(records):
                return records
        raise AssertionError(f"timed out reading {topic}: {len(records)} records, condition not met")
    finally:
        consumer.close()


def read_topic_for(bootstrap: str, topic: str, seconds: float) -> list:
    """Every record of ``topic`` read within ``seconds`` (what is there, however many)."""
    deadline = time.monotonic() + seconds
    return read_topic(bootstrap, topic, lambda _: time.monotonic() >= deadline, seconds + 30)


def publish_actions(bootstrap: str, actions: list) -> None:
    """Put signed actions on the action topic, keyed by run id, as the worker does."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    for a in actions:
        producer.send(topics.ACTIONS, key=a.run_id.encode(), value=a.to_json())
    producer.flush(timeout=30)
    producer.close(timeout=10)


@pytest.fixture(scope="session")
def nan_demo_run(broker, action_keys, chdb_dsn, tmp_path_factory) -> dict:
    """One `nan` demo run through the whole real pipeline, stored in the session's ClickHouse
    (``chdb_dsn``): real torch training on the session broker, a worker of the default group and
    config signing with the session's ``action_keys`` (so it may share partitions with the session
    ``worker``), the sink in this process. The NaN is found, rolled back once and the run completes.
    Returns ``run_demo``'s report (run_id, fault_step, anomalies, actions, rollbacks, ...)."""
    from runwatch.demo.run import DemoOptions, run_demo

    folder = tmp_path_factory.mktemp("nan-demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)  # the demo keeps logs and checkpoints under ./.runwatch
        mp.setenv(topics.SIGNING_KEY_ENV, action_keys.pem)
        mp.setenv(topics.PUBLIC_KEYS_ENV, action_keys.public_text)
        report = run_demo(
            DemoOptions(scenario="nan", steps=160, bootstrap=broker.bootstrap, dsn=chdb_dsn, timeout_s=120)
        )
    assert len(report["rollbacks"]) == 1 and report["steps_completed"] == 160, report
    return report


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium's path (installed with apt-get when root); the tests that open pages in it skip,
    saying why, only where it cannot be had (`make test` installs it through its `browser` target)."""
    from tests.support.chromium import find_chromium

    path, why = find_chromium()
    if path is None:
        pytest.skip(f"headless Chromium is not available: {why}")
    return path


def cpu_bound_mlp() -> tuple[Any, Any, Any, Any]:
    """The contention tests' CPU-bound training step: an MLP (seeded), its SGD optimizer and one batch
    ``(x, y)``; a step takes tens of milliseconds of one core, so CPU hogs beside it slow it down."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer, torch.randn(128, 512), torch.randint(0, 10, (128,))


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    """Folders the deployed services' user owns, under /tmp (tests/support/service_process.py)."""
    from tests.support.service_process import Sandbox

    box = Sandbox()
    try:
        yield box
    finally:
        box.cleanup()


@pytest.fixture(scope="session", autouse=True)
def _spool_in_a_temporary_directory(tmp_path_factory) -> Iterator[None]:
    before = os.environ.get(SPOOL_DIR_ENV)
    os.environ[SPOOL_DIR_ENV] = str(tmp_path_factory.mktemp("spool"))
    yield
    if before is None:
        os.environ.pop(SPOOL_DIR_ENV, None)
    else:
        os.environ[SPOOL_DIR_ENV] = before
