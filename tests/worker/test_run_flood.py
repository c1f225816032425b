"""Issue 23, cases 4 and 5, on the real broker and worker: a flood of 10,000 runs that never send run_end
(crashed jobs, or a client creating runs) is let go once the retention has passed, the detector process
gives the memory back, and after a kill -9 a successor with the default detector timeout restores what
is left and becomes ready (the read of every snapshot and tombstone the flood left reports progress, so
it is not taken for frozen however long it takes)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import RunStartEvent, StepEvent
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from tests.conftest import eventually

pytestmark = pytest.mark.integration

FLOOD = 10_000
RETENTION_S = 20.0
CHECKPOINT_S = 5.0  # state.interval_s's default (worker/runwatch/worker/state/run_states.py)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _counters(worker: WorkerProcess) -> dict:
    return worker.health()[1]["counters"]


def test_a_flood_of_runs_that_never_end_is_let_go_and_a_successor_restores_in_time(tmp_path, action_keys):
    config = tmp_path / "config.yaml"
    # (max_runs above the flood: every run is held until its silence; eviction is the unit tests')
    # (new run ids admitted as fast as they come: the budget that sheds such a flood is run_budget.py's)
    runs = {
        "silence_retention_s": RETENTION_S,
        "max_runs": 2 * FLOOD,
        "new_runs_per_s": 1e6,
        "new_runs_burst": 10**6,
    }
    config.write_text(yaml.safe_dump({"runs": runs}))
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        first = WorkerProcess(
            broker.bootstrap, action_keys.signing, tmp_path / "first.log", config, group="runwatch-flood"
        )
        successor = None
        producer = KafkaProducer(
            bootstrap_servers=broker.bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            linger_ms=20,
            batch_size=256 * 1024,
        )
        try:
            first.wait_ready(90)
            detector_pid = first.health()[1]["detector_process"]["pid"]
            # Warm-up: imports and first allocations, then the baseline
            for i in range(50):
                run = f"warm-{i}"
                producer.send(
                    topics.TELEMETRY,
                    key=run.encode(),
                    value=StepEvent(run_id=run, step=1, loss=1.0).to_json(),
                )
            producer.flush(30)
            eventually(lambda: _counters(first)["processed"] >= 50, 60, "the warm-up runs")
            eventually(
                lambda: _counters(first)["runs_let_go"].get("silent", 0) >= 50,
                3 * RETENTION_S + 30,
                "the warm-up runs to be let go",
            )
            time.sleep(1.0)
            rss_before = _rss_mib(detector_pid)

            # The flood: 10,000 runs, each a run_start and two steps, never an end
            tag = uuid.uuid4().hex[:6]
            for i in range(FLOOD):
                run = f"flood-{tag}-{i}"
                key = run.encode()
                producer.send(topics.TELEMETRY, key=key, value=RunStartEvent(run_id=run).to_json())
                for step in (1, 2):
                    producer.send(
                        topics.TELEMETRY, key=key, value=StepEvent(run_id=run, step=step, loss=1.0).to_json()
                    )
            producer.flush(120)
            flooded_at = time.monotonic()
            eventually(
                lambda: _counters(first)["processed"] >= 50 + 3 * FLOOD, 300, "the flood to be processed"
            )
            peak = _rss_mib(detector_pid)
            held_peak = _counters(first)["runs"]
            # ... then every run of it let go once silent past the retention, with a finding each
            eventually(
                lambda: _counters(first)["runs_let_go"].get("silent", 0) >= FLOOD + 50,
                3 * RETENTION_S + 240,
                "the flood to be let go",
            )
            let_go_s = time.monotonic() - flooded_at
            counters = _counters(first)
            assert counters["runs"] == 0 and counters["runs_let_go"] == {"silent": FLOOD + 50}, counters
            # the freed memory is given back to the system within a few ticks
            rss: list[float] = []
            eventually(
                lambda: rss.append(_rss_mib(detector_pid)) or rss[-1] - rss_before < 100,
                30,
                f"the detector process to shrink to within 100 MiB of {rss_before:.0f} MiB (peak {peak:.0f}, "
                f"now {rss[-1] if rss else peak:.0f})",
                interval=0.5,
            )
            rss_after = rss[-1]
            # The tombstones of runs let go are written at the next checkpoint (every state.interval_s, 5 s):
            # let one be delivered well after the last let-go before the kill -9, which loses what no
            # checkpoint has written yet (a busy machine may still lose a few: see below)
            let_go_seen = time.monotonic()
            eventually(
                lambda: (
                    time.monotonic() - first.health()[1]["last_ack_age_s"] > let_go_seen + 2 * CHECKPOINT_S
                ),
                120,
                "a checkpoint after the flood was let go",
            )

            # kill -9, and a successor with the default detector timeout: it reads every snapshot and
            # tombstone the flood left, restores (almost) nothing of it, and becomes ready
            os.kill(first.process.pid, signal.SIGKILL)
            first.process.wait(30)
            started = time.monotonic()
            successor = WorkerProcess(
                broker.bootstrap,
                action_keys.signing,
                tmp_path / "successor.log",
                config,
                group="runwatch-flood",
            )
            successor.wait_ready(300)
            eventually(lambda: successor.health("/readyz")[0] == 200, 300, "the successor to be ready")
            ready_s = time.monotonic() - started
            health = successor.health()[1]
            restored = health["counters"]["restored_runs"]
            # the flood's tombstones were read: at most the last checkpoint's few runs are restored ...
            assert restored <= FLOOD // 20, health["counters"]
            assert health["detector_process"]["restore"]["phase"] == "done", health["detector_process"]
            # ... and those are let go again once silent past the retention: nothing of the flood lingers
            eventually(
                lambda: _counters(successor)["runs"] == 0,
                3 * RETENTION_S + 60,
                f"the {restored} restored run(s) to be let go",
            )
            assert _counters(successor)["runs_let_go"].get("silent", 0) == restored, _counters(successor)
            assert successor.process.poll() is None
            figures = {
                "flood_runs": FLOOD,
                "rss_before_mib": round(rss_before, 1),
                "rss_peak_mib": round(peak, 1),
                "runs_held_at_peak": held_peak,
                "kib_per_held_run": round((peak - rss_before) * 1024 / max(1, held_peak), 1),
                "rss_after_retention_mib": round(rss_after, 1),
                "let_go_after_flood_s": round(let_go_s, 1),
                "successor_ready_s": round(ready_s, 1),
                "successor_restored_runs": restored,
                "restore": health["detector_process"]["restore"],
            }
            print(json.dumps(figures))
        finally:
            producer.close(timeout=10)
            first.stop()
            if successor is not None:
                successor.stop()
