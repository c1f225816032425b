"""The worker's health endpoint (``--web-port``), for a supervisor's liveness and readiness probes.

- ``GET /livez``: 200 while the worker can make progress: not failed, and its detector process
  alive and answering (no request waiting longer than ``stuck_after_s`` without a progress report:
  a restore of many runs reports its progress); else 503.
- ``GET /readyz``: 200 when live, partitions are assigned, the detector process is ready and the runs
  of the partitions last assigned are restored (from the assignment on: not only once the restore has
  reported progress).
- ``GET /health``: the figures behind both, as JSON (partitions, age of the last offset commit and
  of the last acknowledged batch, the detector process and the latest restore's progress, counters).

A worker that cannot make progress does not wait for a probe: it exits non-zero by itself (see
``WorkerHealth.fail``); the endpoint tells a supervisor (or a person) before that.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

from faust.sensors import Sensor

from runwatch.worker.detector_process import DetectorProcess
from runwatch.worker.latency_histogram import LatencyHistogram
from runwatch.worker.run_budget import RunBudget

log = logging.getLogger(__name__)

STUCK_AFTER_S = 5.0  # a detector request waiting longer than this: not live (it is killed at 30 s)
EXIT_GRACE_S = 15.0  # a failed worker that has not exited by itself this long after failing is ended


class WorkerHealth:
    """What the worker knows about its own progress; read by the health endpoint."""

    def __init__(self, detectors: DetectorProcess, stuck_after_s: float = STUCK_AFTER_S):
        self.detectors = detectors
        self.stuck_after_s = stuck_after_s
        self.started = time.monotonic()
        self.partitions: list[str] = []
        self.last_commit: float | None = None
        self.last_ack: float | None = None
        self.events_submitted = 0  # telemetry events handed to the detector process
        self.publish_failures = 0  # publish attempts that failed (each retried before the worker fails)
        self.shed_letters = 0  # dead letters published for events shed over their runs' budget
        self.latency = LatencyHistogram()  # detection latency, once per finding delivered (metrics)
        # telemetry partitions assigned whose runs are being restored (None: none); set at the assignment
        self.restoring: list[int] | None = None
        self.log_id: object = None  # the telemetry topic's id as last read (log_identity.py)
        self.commits_refused = 0  # telemetry offsets not committed: an old log's positions on a new log
        self.budget: RunBudget | None = None  # the per-run budgets (run_budget.py), once the app has one
        self.failure: str | None = None
        self._exit_timer: threading.Timer | None = None

    def fail(self, reason: str, exit_code: int = 1, grace_s: float = EXIT_GRACE_S) -> None:
        """The worker cannot make progress: say so, and make sure the process ends non-zero. Faust's
        own crash path shuts down in order, which can hang on a stuck broker or child; this timer
        ends the process if it is still here ``grace_s`` later."""
        if self.failure is None:
            self.failure = reason
            log.error("worker failing: %s", reason)
            self._exit_timer = threading.Timer(grace_s, _hard_exit, args=(exit_code, reason))
            self._exit_timer.daemon = True
            self._exit_timer.start()

    def live(self) -> tuple[bool, str]:
        if self.failure is not None:
            return False, self.failure
        detector = self.detectors.health()
        if not detector["alive"]:
            return False, f"detector process not alive: {detector['failure'] or 'exited'}"
        if detector["stalled_s"] > self.stuck_after_s:
            return (
                False,
                f"detector process has neither answered nor made progress for {detector['stalled_s']:.1f} s",
            )
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        live, why = self.live()
        if not live:
            return False, why
        if not self.detectors.health()["ready"]:
            return False, "detector process starting"
        if not self.partitions:
            return False, "no partitions assigned"
        if self.restoring is not None:
            return False, f"restoring runs of partitions {self.restoring} (assigned)"
        restore = self.detectors.health()["restore"]
        if restore is not None and restore["phase"] != "done":
            return False, f"restoring runs of partitions {restore['partitions']} ({restore['phase']})"
        return True, "ok"

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        live, live_why = self.live()
        ready, ready_why = self.ready()
        counters = self.detectors.counters
        return {
            "live": live,
            "ready": ready,
            "reason": live_why if not live else ready_why,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started, 3),
            "partitions": self.partitions,
            "last_commit_age_s": None if self.last_commit is None else round(now - self.last_commit, 3),
            "last_ack_age_s": None if self.last_ack is None else round(now - self.last_ack, 3),
            "events_submitted": self.events_submitted,
            "publish_failures": self.publish_failures,
            "telemetry_topic_id": self.log_id if isinstance(self.log_id, str) else None,
            "commits_refused": self.commits_refused,
            "detector_process": self.detectors.health(),
            "counters": {
                **asdict(counters),
                "actions": dict(counters.actions),
                "findings": {f"{d}/{s}": n for (d, s), n in counters.findings.items()},
                "runs_let_go": dict(counters.runs_let_go),
                "events_shed": self.budget.shed_total if self.budget is not None else 0,
                "events_shed_new_runs": self.budget.shed_new_runs if self.budget is not None else 0,
            },
        }


def _hard_exit(code: int, reason: str) -> None:
    log.critical("worker did not stop within its grace period after failing (%s); exiting %d", reason, code)
    logging.shutdown()
    os._exit(code)


class CommitSensor(Sensor):
    """Records when the worker's consumer last committed offsets (Faust's sensor hook)."""

    def __init__(self, health: WorkerHealth, **kwargs: Any):
        super().__init__(**kwargs)
        self._health = health

    def on_commit_completed(self, consumer: Any, state: Any) -> None:
        self._health.last_commit = time.monotonic()
