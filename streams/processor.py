"""The worker's per-message logic, free of Faust so tests can drive it directly.

Bytes in; dead letters, anomalies and signed actions out. Per-run state is a
``RunMonitor`` per run id; the run's partition owns it (key = run_id).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from runwatch.detectors import MonitorOutput, RunMonitor, RunwatchConfig
from runwatch.detectors.policy import ActionDecision
from runwatch.producer import topics
from runwatch.producer.schema import (
    Action,
    Anomaly,
    DeadLetter,
    JoinedStep,
    RunEndEvent,
    SchemaError,
    action_expiry,
    decode_event,
    utc_now,
)
from runwatch.producer.signing import sign_action

log = logging.getLogger("runwatch.worker")


@dataclass
class ProcessResult:
    deadletter: DeadLetter | None = None
    anomalies: list[Anomaly] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    joined: list[JoinedStep] = field(default_factory=list)  # multi-rank runs' joined steps


@dataclass
class WorkerCounters:
    processed: int = 0
    deadlettered: int = 0
    anomalies: int = 0
    actions: Counter = field(default_factory=Counter)


class TelemetryProcessor:
    def __init__(self, config: RunwatchConfig, secret: bytes, clock: Callable[[], datetime] = utc_now):
        self.config = config
        self._secret = secret
        self._clock = clock  # wall clock for issued_at/expires_at: expiry is checked by trainers in real time
        self.monitors: dict[str, RunMonitor] = {}
        self._last_seen: dict[str, tuple[datetime, datetime]] = {}  # run -> (newest event ts, when it arrived)
        self._partition: dict[str, int] = {}  # run -> the telemetry partition its events come from
        self.counters = WorkerCounters()

    def process(
        self, raw: bytes, key: bytes | None = None, partition: int | None = None, offset: int | None = None
    ) -> ProcessResult:
        try:
            event = decode_event(raw)
        except SchemaError as exc:
            self.counters.deadlettered += 1
            return ProcessResult(deadletter=self._deadletter(exc.reason, raw, key, partition, offset))
        if key is not None and key != event.run_id.encode():
            # The key decides the partition, hence which worker owns the run's state.
            self.counters.deadlettered += 1
            reason = f"key {key!r} does not match run_id {event.run_id!r}"
            return ProcessResult(deadletter=self._deadletter(reason, raw, key, partition, offset))
        self.counters.processed += 1
        monitor = self.monitors.get(event.run_id)
        if monitor is None:
            monitor = self.monitors[event.run_id] = RunMonitor(event.run_id, self.config)
        out = monitor.observe(event)
        previous = self._last_seen.get(event.run_id)
        if previous is None or event.ts >= previous[0]:
            self._last_seen[event.run_id] = (event.ts, self._clock())
        if partition is not None:
            self._partition[event.run_id] = partition
        if isinstance(event, RunEndEvent):
            del self.monitors[event.run_id]
            del self._last_seen[event.run_id]
            self._partition.pop(event.run_id, None)
        return self._result(out)

    def keep_partitions(self, partitions: set[int]) -> list[str]:
        """After a rebalance: drop the runs whose partition this worker no longer owns (their new
        owner rebuilds them), so timers only ever judge runs this worker holds. Returns them."""
        dropped = [run for run, p in self._partition.items() if p not in partitions]
        for run in dropped:
            self.monitors.pop(run, None)
            self._last_seen.pop(run, None)
            del self._partition[run]
        return dropped

    def tick(self, now: datetime | None = None) -> ProcessResult:
        """Time-based checks (stalled or silent ranks) for every run this worker holds.

        Each run is ticked on its own event time, carried forward by the wall clock since its
        last event arrived: for a live run that is the wall clock, and a backlog read after a
        restart is judged on the time its events were sent, as ``runwatch replay`` does.
        """
        now = now or self._clock()
        result = ProcessResult()
        for run_id, monitor in list(self.monitors.items()):
            event_ts, arrived = self._last_seen[run_id]
            part = self._result(monitor.tick(event_ts + (now - arrived)))
            result.anomalies.extend(part.anomalies)
            result.actions.extend(part.actions)
            result.joined.extend(part.joined)
        return result

    def _result(self, out: MonitorOutput) -> ProcessResult:
        result = ProcessResult(anomalies=out.anomalies, actions=[self._action(d) for d in out.decisions],
                               joined=out.joined)
        self.counters.anomalies += len(result.anomalies)
        for anomaly in result.anomalies:
            log.info("anomaly run=%s step=%s %s: %s", anomaly.run_id, anomaly.step, anomaly.detector, anomaly.message)
        for action in result.actions:
            self.counters.actions[action.kind] += 1
            log.info("action run=%s %s (%s)", action.run_id, action.kind, action.reason)
        return result

    def _action(self, decision: ActionDecision) -> Action:
        issued = self._clock()
        action = Action(
            action_id=decision.action_id,
            run_id=decision.run_id,
            kind=decision.kind,
            reason=decision.reason,
            anomaly_ids=decision.anomaly_ids,
            step=decision.step,
            onset_step=decision.onset_step,
            target_checkpoint=decision.target_checkpoint,
            params=self._with_job(decision),
            issued_at=issued,
            expires_at=action_expiry(issued, self.config.policy.action_ttl_s),
        )
        return sign_action(action, self._secret)

    def _with_job(self, decision: ActionDecision) -> dict:
        """The run's job_id, host and pod (from its run_start) join the action's params, signed with it."""
        monitor = self.monitors.get(decision.run_id)
        job = monitor.job if monitor is not None else {}
        return {**job, **decision.params} if job else decision.params

    @staticmethod
    def _deadletter(reason: str, raw: bytes, key: bytes | None, partition: int | None, offset: int | None) -> DeadLetter:
        return DeadLetter(
            reason=reason,
            source_topic=topics.TELEMETRY,
            partition=partition,
            offset=offset,
            key=key.decode(errors="replace") if key is not None else None,
            raw=raw.decode(errors="replace"),
        )
