"""Issue 35, item 9: ``/readyz`` answered ready before the state restore had started. A worker given
partitions with runs to restore reported ready from the assignment until the restore's first progress
report (about a second later): a supervisor rolling workers over would route on, or stop the predecessor,
while nothing was restored. Here a real worker restores 400 runs from a real broker, its /health is read
every few milliseconds from its start, and it says ready only with every run restored."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.local.worker_process import WorkerProcess, launcher_state_secret
from runwatch.worker.processor import TelemetryProcessor
from runwatch.worker.state.run_states import StateOptions
from tests.conftest import eventually
from tests.support.action_keys import SEED
from tests.worker.test_poison_cases import partition_of

pytestmark = pytest.mark.integration

RUNS = 400


class _EmptyStateTopic:
    """A state reader with nothing to read back (the runs below are new)."""

    topic = topics.STATE
    origin: dict = {}

    def read(self, partitions):
        return {}

    def scan(self, *args, **kwargs):
        return iter(())


def _snapshots(group: str) -> list:
    """The state records of RUNS runs of a few steps each, as a worker of ``group`` writes them."""
    proc = TelemetryProcessor(
        RunwatchConfig(),
        SEED,
        state_reader=_EmptyStateTopic(),  # type: ignore[arg-type]
        state=StateOptions(every_events=10_000, interval_s=1e9),
        group=group,
        state_secret=launcher_state_secret().encode(),
    )
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    for i in range(RUNS):
        run_id = f"restore-{i}"
        key = run_id.encode()
        for step in range(5):
            event = StepEvent(run_id=run_id, step=step, loss=1.0, ts=t0 + timedelta(seconds=step))
            proc.process(event.to_json(), key=key, partition=partition_of(key), offset=step)
    records, _ = proc.take_snapshots(force_checkpoint=True)
    assert len(records) == RUNS
    return records


def test_readyz_is_not_ready_until_the_assigned_partitions_runs_are_restored(
    own_broker, action_keys, tmp_path
):
    broker = own_broker  # (its flood stays off the session broker)
    group = f"runwatch-readyz-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(
        bootstrap_servers=broker.bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        max_request_size=topics.STATE_MAX_BYTES,
    )
    for r in _snapshots(group):
        producer.send(topics.STATE, key=r.key.encode(), value=r.value, partition=r.partition)
    producer.flush(30)
    producer.close()

    worker = WorkerProcess(broker.bootstrap, action_keys.signing, tmp_path / "worker.log", group=group)
    seen: list[tuple[bool, int, object]] = []  # (ready, runs restored, the restore's phase) in order
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                _, body = worker.health(timeout=1.0)
            except OSError:
                time.sleep(0.01)
                continue
            restore = (body.get("detector_process") or {}).get("restore") or {}
            seen.append(
                (body["ready"], (body.get("counters") or {}).get("restored_runs", 0), restore.get("phase"))
            )
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        eventually(lambda: any(ready for ready, _, _ in seen), 120, "the worker to be ready")
        done.set()
        watcher.join(5)
        first = next(i for i, (ready, _, _) in enumerate(seen) if ready)
        assert any(restored == 0 for _, restored, _ in seen[:first])  # (the endpoint answered before)
        assert all(restored == RUNS for ready, restored, _ in seen if ready), seen[first - 3 : first + 3]
        assert worker.health("/readyz")[0] == 200
    finally:
        done.set()
        worker.stop()
