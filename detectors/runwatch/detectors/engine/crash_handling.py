"""``RunCrashes``: how a run's monitor takes its ranks' last words (issue 39), mixed into ``RunMonitor``.

A rank's crash is classified when it comes (engine/crashes.py); the cause is named and acted on once the
attempt's crashes are gathered (``CrashWatch``), and ends the attempt. What the crashes leave is handed on
to the run's next attempt (``crash_ledger``, ``take_crash_history``).
"""

from __future__ import annotations

from datetime import datetime

from runwatch.contract.schema import Anomaly, CrashEvent
from runwatch.detectors.baselines.gate import RunEndBaselineCheck
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.anomalies import anomaly_of
from runwatch.detectors.engine.crashes import (
    CrashDecision,
    CrashHistory,
    CrashReport,
    CrashWatch,
    cause_finding,
    consequence_finding,
    crash_action,
    thread_finding,
)
from runwatch.detectors.engine.output import MonitorOutput
from runwatch.detectors.engine.policy import ActionPolicy
from runwatch.detectors.engine.progress import RunProgress
from runwatch.detectors.engine.rank_join import StepJoin
from runwatch.detectors.findings import Finding


class RunCrashes:
    """The crash handling of a ``RunMonitor`` (see the module doc), which has the state it reads."""

    # This attempt's crashes (engine/crashes.py), and what the run's earlier attempts' left (the worker
    # hands it on to a new attempt's monitor: ``take_crash_history``). None: no crash yet.
    crashes: CrashWatch | None = None
    crash_history: CrashHistory | None = None
    # The monitor's (monitor.py)
    run_id: str
    config: RunwatchConfig
    progress: RunProgress
    join: StepJoin
    policy: ActionPolicy
    baseline: RunEndBaselineCheck
    attempt: str | None
    job: dict[str, str]
    last_step: int | None
    ended_at: datetime | None

    def _on_crash(self, event: CrashEvent, out: MonitorOutput) -> None:
        """A rank's last words: classified now; the cause named and acted on once the attempt's crashes are
        gathered (engine/crashes.py). A thread that died is said at once and acted on by none."""
        rank_progress = self.progress.ranks.get(event.rank)
        step = rank_progress.step if rank_progress is not None and rank_progress.step is not None else None
        report = CrashReport.of(event, step if step is not None else self.last_step)
        if event.source == "thread_exception":
            self._emit_crash(thread_finding(report), event.ts, f"{event.event_id}|thread", out, None)
            return
        watch = self.crashes
        if watch is None:
            watch = self.crashes = CrashWatch(self.config.policy.crash, self.crash_history)
        if watch.settled is not None:
            if report.rank != watch.settled.rank:  # (the cause's own second word says nothing new)
                watch.late += 1
                self._emit_crash(
                    consequence_finding(report, watch.settled), event.ts, event.event_id, out, None
                )
            return
        watch.add(report)
        self._settle_crashes(event.ts, out)

    def _settle_crashes(self, now: datetime | None, out: MonitorOutput) -> None:
        """Name the cause once the crashes are gathered (``now`` None: at once), issue its action, and end
        the attempt: a dead run stalls, hangs and escalates no more."""
        watch = self.crashes
        if watch is None or watch.settled is not None or not watch.pending:
            return
        if now is not None and not watch.due(now, self.join.world_size):
            return
        settled = watch.settle(policy_stopped=self.policy.stopped)
        if settled is None:
            return
        cause = settled.cause
        at = max(r.ts for r in [cause, *settled.consequences])
        anomaly = self._emit_crash(cause_finding(settled), at, cause.event_id, out, settled.decision)
        for report in settled.consequences:
            self._emit_crash(consequence_finding(report, cause), at, report.event_id, out, None)
        if anomaly is not None and settled.decision.kind == "stop":
            self.policy.stopped = True
        if self.ended_at is None:
            self.ended_at = at

    def _emit_crash(
        self, finding: Finding, ts: datetime, cause: str, out: MonitorOutput, decision: CrashDecision | None
    ) -> Anomaly | None:
        """A crash finding, and the crash policy's action (never the rules': a crash is not a detector's
        figure to alert on, its action is the class's)."""
        anomaly = anomaly_of(self.run_id, finding, ts, cause)
        out.anomalies.append(anomaly)
        self.baseline.add_anomaly(anomaly)
        action = crash_action(decision, anomaly, self.attempt, self.job) if decision is not None else None
        if action is not None:
            out.decisions.append(action)
        return anomaly

    def crash_ledger(self) -> CrashHistory | None:
        """What this run's crashes (and a stop) leave for its next attempt (None: nothing)."""
        history = self.crashes.history if self.crashes is not None else self.crash_history
        if history is None and not self.policy.stopped:
            return None
        history = history if history is not None else CrashHistory()
        history.stopped = history.stopped or self.policy.stopped
        return history

    def take_crash_history(self, history: CrashHistory | None, *, new_attempt: bool) -> None:
        """A fresh monitor of the run takes on what its crashes left: the identical crashes and restarts
        count on. A ``new_attempt`` (a run_start: restarted, or started again by someone) starts unstopped;
        anything else is the same attempt's last words after the worker let it go, and a stopped run stays
        stopped (its exit after the stop is never restarted)."""
        if history is None:
            return
        if new_attempt:
            history.stopped = False
        self.crash_history = history
        if history.stopped:
            self.policy.stopped = True
