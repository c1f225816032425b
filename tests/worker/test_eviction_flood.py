"""Issue 35, item 4, on the real broker and worker: a flood of 10,000 fake run ids (half of them never
send a step) against a worker that holds 1,000 runs. A live run with a confirmed-good checkpoint, stepping
through the flood, is never evicted and its NaN gets a rollback; a quiet run with one is evicted (it is the
least active), keeps its checkpoint ledger, and when it comes back its NaN gets a rollback too, not
``stop: no confirmed-good checkpoint``. (Before: eviction took the least recently active run, so any
producer chose which runs went, and a run evicted lost its checkpoint record.)"""

from __future__ import annotations

import math
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import (
    CheckpointEvent,
    RunStartEvent,
    StepEvent,
    decode_action,
    decode_anomaly,
)
from tests.conftest import eventually, read_topic, worker_with_config

pytestmark = pytest.mark.integration

FLOOD = 10_000
MAX_RUNS = 1_000
ACTIVE_S = 5.0  # runs.active_s: a run quiet this long is evictable before active ones


def _counters(worker) -> dict:
    return worker.health()[1]["counters"]


def test_a_flood_of_run_ids_evicts_neither_a_live_run_nor_what_a_quiet_one_needs_to_roll_back(
    own_broker, action_keys, tmp_path
):
    broker = own_broker  # (its flood stays off the session broker)
    tag = uuid.uuid4().hex[:8]
    live, quiet = f"live-{tag}", f"quiet-{tag}"
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    # (new run ids admitted as fast as they come: this is eviction's test; run_budget.py's sheds such a
    # flood by default, test_partition_flood.py and tests/worker/test_run_budget.py)
    config = {
        "runs": {"max_runs": MAX_RUNS, "active_s": ACTIVE_S, "new_runs_per_s": 1e6, "new_runs_burst": 10**6}
    }
    producer = KafkaProducer(
        bootstrap_servers=broker.bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        linger_ms=20,
        batch_size=256 * 1024,
    )
    steps = {live: 0, quiet: 0}

    def step(run_id: str, loss: float = 1.0) -> None:
        steps[run_id] += 1
        ts = t0 + timedelta(seconds=steps[run_id])
        event = StepEvent(run_id=run_id, step=steps[run_id], loss=loss, grad_norm=1.0, ts=ts)
        producer.send(topics.TELEMETRY, key=run_id.encode(), value=event.to_json())

    def start(run_id: str) -> None:
        producer.send(
            topics.TELEMETRY, key=run_id.encode(), value=RunStartEvent(run_id=run_id, ts=t0).to_json()
        )
        for _ in range(30):  # a checkpoint at step 5, confirmed good 20 steps later
            step(run_id)
            if steps[run_id] == 5:
                ckpt = CheckpointEvent(run_id=run_id, step=5, uri=f"/ckpt/{run_id}/5.pt", ts=t0)
                producer.send(topics.TELEMETRY, key=run_id.encode(), value=ckpt.to_json())

    with worker_with_config(broker, action_keys, tmp_path, config, group=f"runwatch-flood-{tag}") as worker:
        try:
            start(quiet)
            start(live)
            producer.flush(30)
            eventually(lambda: _counters(worker)["processed"] >= 62, 60, "both runs' first steps")
            # The live run goes on stepping; the quiet run is quiet past runs.active_s before the flood
            stop = threading.Event()

            def live_goes_on() -> None:
                while not stop.wait(0.5):
                    step(live)

            stepper = threading.Thread(target=live_goes_on, daemon=True)
            stepper.start()
            time.sleep(ACTIVE_S + 1)

            # The flood
            started = time.monotonic()
            for i in range(FLOOD):
                fake = f"fake-{tag}-{i}"
                event = (
                    StepEvent(run_id=fake, step=1, loss=1.0, ts=t0)
                    if i % 2
                    else RunStartEvent(run_id=fake, ts=t0)
                )
                producer.send(topics.TELEMETRY, key=fake.encode(), value=event.to_json())
            producer.flush(60)
            flood_s = time.monotonic() - started
            eventually(
                lambda: _counters(worker)["runs_let_go"].get("evicted", 0) >= FLOOD - MAX_RUNS,
                180,
                "the flood to push runs out",
            )
            stop.set()
            stepper.join(5)

            # Then a NaN streak of each: the quiet run is back (it was evicted, with its ledger)
            for run_id in (live, quiet):
                for _ in range(3):
                    step(run_id, math.nan)
            producer.flush(30)

            def kinds(run_id: str, records) -> list[str]:
                return [decode_action(r.value).kind for r in records if r.key == run_id.encode()]

            records = read_topic(
                broker.bootstrap,
                topics.ACTIONS,
                lambda rs: all({"rollback", "stop"} & set(kinds(r, rs)) for r in (live, quiet)),
                120,
            )
            assert kinds(live, records) == ["alert", "rollback"], kinds(live, records)
            assert kinds(quiet, records) == ["alert", "rollback"], kinds(quiet, records)
            targets = {
                a.run_id: a.target_checkpoint.uri
                for a in (decode_action(r.value) for r in records)
                if a.kind == "rollback" and a.run_id in (live, quiet) and a.target_checkpoint
            }
            assert targets == {live: f"/ckpt/{live}/5.pt", quiet: f"/ckpt/{quiet}/5.pt"}, targets

            def let_go(records) -> dict[str, str]:
                found = [decode_anomaly(r.value) for r in records if r.key in (live.encode(), quiet.encode())]
                return {
                    a.run_id: a.evidence.get("reason", "") for a in found if a.detector == "run_lifecycle"
                }

            evicted = let_go(
                read_topic(broker.bootstrap, topics.ANOMALIES, lambda rs: quiet in let_go(rs), 60)
            )
            assert evicted == {quiet: "inactive"}, evicted  # never the live run
            counters = _counters(worker)
            assert counters["ledgers_resumed"] >= 1 and counters["runs"] <= MAX_RUNS, counters
            print(
                {"flood_runs": FLOOD, "flood_sent_s": round(flood_s, 2), "evicted": counters["runs_let_go"]}
            )
        finally:
            producer.close(timeout=10)
