"""A monitor's output made into what the worker publishes: findings with their detection time, signed
actions with their job's params, dead letters, and a run reset by a detector error."""

from __future__ import annotations

import logging
import traceback
from typing import Any, TypeVar

from runwatch.contract import topics
from runwatch.contract.schema import (
    CLOCK_AHEAD_PARAM,
    Action,
    Anomaly,
    DeadLetter,
    action_expiry,
)
from runwatch.detectors import MonitorOutput, RunMonitor
from runwatch.detectors.engine.group_monitor import GroupMonitor
from runwatch.detectors.engine.policy import ActionDecision
from runwatch.worker.processing.held_runs import HeldRuns
from runwatch.worker.processing.results import ProcessResult
from runwatch.worker.split_runs import (
    signed_reports,
)

log = logging.getLogger(__name__)

_Published = TypeVar("_Published", Anomaly, Action)


class RunOutputs(HeldRuns):
    """What runs say, as records to publish (TelemetryProcessor's second layer)."""

    def _reset_run(
        self,
        run_id: str,
        exc: BaseException,
        raw: bytes | None,
        key: bytes | None,
        partition: int | None,
        offset: int | None,
    ) -> ProcessResult:
        """A detector raised: drop the run's state (its detectors re-warm from the next event) and
        dead-letter a ``detector_error`` with the traceback; every other run goes on."""
        self.counters.detector_errors += 1
        self._forget(run_id, "reset")
        trace = traceback.format_exc()
        log.error("detector error on run %s (its state is reset): %r", run_id, exc)
        letter = DeadLetter.for_message(
            f"detector_error: {type(exc).__name__}: {exc}",
            raw,
            source_topic=topics.TELEMETRY,
            partition=partition,
            offset=offset,
            key=key if key is not None else run_id.encode(),
            stage="detector",
            traceback=trace,
        )
        return ProcessResult(errors=[letter])

    def _result(self, out: MonitorOutput, monitor: RunMonitor | None = None) -> ProcessResult:
        # detected_at: this worker's wall clock when the monitor produced them (the monitor has no clock;
        # their ts is the event time of what they are about), so detected_at - ts is the detection latency.
        detected = self._clock() if out.anomalies else None
        anomalies = [a.model_copy(update={"detected_at": detected}) for a in out.anomalies]
        actions = [self._action(d) for d in out.decisions]
        if self._published:  # (a restored run's predecessor published something)
            anomalies, actions = self._not_published(anomalies), self._not_published(actions)
        result = ProcessResult(anomalies=anomalies, actions=actions, joined=out.joined)
        if out.report and isinstance(monitor, GroupMonitor):
            result.reports += signed_reports(monitor, out.report, self._clock(), self._signing_key)
        self.counters.anomalies += len(result.anomalies)
        for anomaly in result.anomalies:
            self.counters.findings[(anomaly.detector, anomaly.severity)] += 1
            log.info(
                "anomaly run=%s step=%s %s: %s",
                anomaly.run_id,
                anomaly.step,
                anomaly.detector,
                anomaly.message,
            )
        for action in result.actions:
            self.counters.actions[action.kind] += 1
            log.info("action run=%s %s (%s)", action.run_id, action.kind, action.reason)
        return result

    def _not_published(self, records: list[_Published]) -> list[_Published]:
        """Leave out what a predecessor already published as it is (published.py)."""
        kept = []
        for record in records:
            if self._published.is_repeat(record):
                self.counters.repeats_withheld += 1
                log.info(
                    "run %s: %s already published before this worker restored the run: not sent again",
                    record.run_id,
                    record.anomaly_id if isinstance(record, Anomaly) else record.action_id,
                )
            else:
                kept.append(record)
        return kept

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
            attempt=decision.attempt,
            issued_at=issued,
            expires_at=action_expiry(issued, self.config.policy.action_ttl_s),
        )
        return self._signing_key.sign(action)

    def _with_job(self, decision: ActionDecision) -> dict[str, Any]:
        """The run's job_id, host and pod (from its run_start, which the decision carries) join the action's
        params, signed with it, and the offsets of the ranks whose clocks are ahead of the worker's
        (``Action.issuer_now``)."""
        job = decision.job
        params = {**job, **decision.params} if job else decision.params
        monitor = self.monitors.get(decision.run_id)
        if monitor is not None and monitor.clock_ahead:  # (ranks whose clock is fast: RunMonitor.clock_seen)
            params = {**params, CLOCK_AHEAD_PARAM: {str(r): s for r, s in monitor.clock_ahead.items()}}
        return params

    @staticmethod
    def _deadletter(
        reason: str, raw: bytes | None, key: bytes | None, partition: int | None, offset: int | None
    ) -> DeadLetter:
        return DeadLetter.for_message(
            reason, raw, source_topic=topics.TELEMETRY, partition=partition, offset=offset, key=key
        )
