"""Crashes of one run (issue 39): which rank's death is the cause, which are its consequences, and what the
cause becomes (a signed ``restart``, with or without the failing host, or a ``stop``).

A ``crash`` event is classified when it arrives (``crash_classes.classify``: rules, each explainable). In a
run of several ranks one death brings down the others (a peer is gone, so their collectives fail): the
crashes of one attempt are gathered for ``settle_s`` after the first (or until every rank has crashed), then
the earliest death by its event time is the **cause** and the others are its **consequences** (findings of
severity info that name the cause; never a restart per rank). A run of one rank is decided at once.

The cause's class picks the action from the policy table (``CrashPolicyConfig.actions``). A stop wins over
every restart when: the class says stop; the same class at the same step has crashed the run
``max_identical`` times over its attempts (a third identical crash is never restarted); the run has been
restarted ``max_restarts`` times; or the run was already stopped (by its policy, or by an earlier crash).
What crosses attempts is ``CrashHistory`` (a new attempt is a fresh monitor: the worker hands it on).

Pure: no I/O, no clock (event times and ``now`` from the caller). Pickles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from runwatch.contract.schema import CrashEvent, Severity
from runwatch.detectors.config import CrashPolicyConfig
from runwatch.detectors.crash_classes import CrashVerdict, classify
from runwatch.detectors.findings import Finding

CRASH = "crash"  # the finding's detector name (registry.POLICY_FINDINGS)
# A host name an action may carry: what the remediator's host rule accepts too (sinks/.../templates.py). A
# crash event's host is the trainer's word: anything else (a shell metacharacter, a leading '-') is dropped.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}", re.ASCII)
MAX_PENDING = 256  # crash reports gathered per attempt at most (one per rank is kept; peers beyond: counted)
MAX_HISTORY = 64  # (class, step) pairs a run remembers
EVIDENCE_LINE_CHARS = 512


def valid_host(host: str | None) -> str | None:
    """``host`` if it may name a host in an action (``HOST_NAME``, no ``..``), else None."""
    if host is None or ".." in host or not HOST_NAME.fullmatch(host):
        return None
    return host


def crash_text(event: CrashEvent) -> str:
    """Everything the crash said, for the classifier: message, traceback, log tail."""
    parts = [event.message, event.traceback, event.log_tail]
    return "\n".join(p for p in parts if p)


@dataclass
class CrashReport:
    """One rank's crash, classified."""

    rank: int
    ts: datetime
    event_id: str
    step: int | None
    source: str
    host: str | None  # as the event said it (bounded); ``valid_host`` decides whether an action may name it
    signal: int | None
    exit_code: int | None
    exception_type: str | None
    verdict: CrashVerdict

    @classmethod
    def of(cls, event: CrashEvent, step: int | None) -> CrashReport:
        verdict = classify(
            text=crash_text(event),
            exception_type=event.exception_type,
            signal=event.signal,
            exit_code=event.exit_code,
        )
        return cls(
            rank=event.rank,
            ts=event.ts,
            event_id=event.event_id,
            step=event.step if event.step is not None else step,
            source=event.source,
            host=event.host,
            signal=event.signal,
            exit_code=event.exit_code,
            exception_type=event.exception_type,
            verdict=verdict,
        )

    def evidence(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "crash_class": v.crash_class,
            "rule": v.rule,
            "evidence_line": v.evidence_line[:EVIDENCE_LINE_CHARS],
            "explanation": v.explanation[:EVIDENCE_LINE_CHARS],
            "host": self.host,
            "rank": self.rank,
            "signal": self.signal,
            "exit_code": self.exit_code,
            "source": self.source,
            "exception_type": self.exception_type,
            "crash_event_id": self.event_id,
        }


@dataclass
class CrashHistory:
    """What a run's crashes leave for its next attempts: how often each (class, step) was the cause, the
    restarts issued, whether the run was stopped."""

    identical: dict[str, int] = field(default_factory=dict)  # "class@step" -> times it was the cause
    restarts: int = 0
    stopped: bool = False

    def count(self, crash_class: str, step: int | None) -> int:
        key = f"{crash_class}@{step}"
        self.identical[key] = self.identical.get(key, 0) + 1
        while len(self.identical) > MAX_HISTORY:
            self.identical.pop(next(iter(self.identical)))
        return self.identical[key]


@dataclass(frozen=True)
class CrashDecision:
    """What the cause becomes: ``kind`` ``restart`` or ``stop`` (None: no action), its reason and params."""

    kind: str | None
    reason: str
    params: dict[str, Any]


@dataclass
class CrashSettled:
    cause: CrashReport
    consequences: list[CrashReport]
    decision: CrashDecision


class CrashWatch:
    """One attempt's crashes: gathered, then settled once (``settle``)."""

    def __init__(self, config: CrashPolicyConfig, history: CrashHistory | None = None):
        self.config = config
        self.history = history if history is not None else CrashHistory()
        self.pending: dict[int, CrashReport] = {}  # rank -> its first crash
        self.opened_at: datetime | None = None
        self.settled: CrashReport | None = None  # the cause, once named
        self.late: int = 0  # crashes after the cause was named (consequences said one by one)

    def add(self, report: CrashReport) -> None:
        if self.opened_at is None:
            self.opened_at = report.ts
        if report.rank not in self.pending and len(self.pending) < MAX_PENDING:
            self.pending[report.rank] = report

    def due(self, now: datetime, world_size: int) -> bool:
        """Whether the gathered crashes are to be settled at ``now``."""
        if self.settled is not None or self.opened_at is None:
            return False
        if world_size <= 1 or len(self.pending) >= world_size:
            return True
        return now - self.opened_at >= timedelta(seconds=self.config.settle_s)

    def settle(self, *, policy_stopped: bool) -> CrashSettled | None:
        if self.settled is not None or not self.pending:
            return None
        # The earliest death is the cause; at the same time a launcher's word (the process died) or a
        # signal before an exception that a peer's loss raised.
        ordered = sorted(self.pending.values(), key=lambda r: (r.ts, r.source != "launcher", r.rank))
        cause, consequences = ordered[0], ordered[1:]
        self.settled = cause
        return CrashSettled(cause, consequences, self.decide(cause, policy_stopped=policy_stopped))

    def decide(self, cause: CrashReport, *, policy_stopped: bool) -> CrashDecision:
        config, history = self.config, self.history
        crash_class = cause.verdict.crash_class
        mode = config.actions.get(crash_class, "as_was")
        times = history.count(crash_class, cause.step)
        base: dict[str, Any] = {"crash_class": crash_class, "rule": cause.verdict.rule, "rank": cause.rank}
        where = (
            f"rank {cause.rank} crashed at step {cause.step}: {crash_class} ({cause.verdict.evidence_line})"
        )
        if policy_stopped or history.stopped:
            return CrashDecision(None, f"{where}; the run was stopped: not restarted", base)
        stop_why: str | None = None
        if mode == "none":
            return CrashDecision(None, f"{where}; the policy takes no action on {crash_class}", base)
        if mode == "stop":
            stop_why = f"{crash_class}: a restart would crash again"
        elif times >= config.max_identical:
            stop_why = (
                f"the same crash ({crash_class} at step {cause.step}) {times} times: never restarted again"
            )
        elif history.restarts >= config.max_restarts:
            stop_why = f"{history.restarts} restarts already (max_restarts {config.max_restarts})"
        if stop_why is not None:
            history.stopped = True
            return CrashDecision(
                "stop", f"{where}; stop: {stop_why}", {**base, "cause": "crash", "identical": times}
            )
        host = valid_host(cause.host)
        exclude = [host] if mode == "exclude_host" and host is not None else []
        note = ""
        if mode == "exclude_host" and host is None:
            note = " (its host is unknown or not a valid host name: restarted as it was)"
        history.restarts += 1
        params = {
            **base,
            "mode": "exclude_host" if exclude else "as_was",
            "exclude_hosts": exclude,
            "restart_number": history.restarts,
            "identical": times,
        }
        how = f"restart without {host}" if exclude else "restart as it was"
        return CrashDecision("restart", f"{where}; {how}{note}", params)


def cause_finding(settled: CrashSettled) -> Finding:
    cause = settled.cause
    v = cause.verdict
    severity: Severity = "info" if v.crash_class == "preemption" else "critical"
    peers = sorted(r.rank for r in settled.consequences)
    evidence = cause.evidence() | {"role": "cause", "consequences": peers[:64]}
    return Finding(
        detector=CRASH,
        metric=v.crash_class,
        step=cause.step,
        rank=cause.rank,
        severity=severity,
        message=f"rank {cause.rank} crashed: {v.crash_class} ({v.evidence_line[:200]})"
        + (f"; ranks {_ranks(peers)} crashed after it (its consequences)" if peers else ""),
        evidence=evidence,
    )


def consequence_finding(report: CrashReport, cause: CrashReport) -> Finding:
    v = report.verdict
    return Finding(
        detector=CRASH,
        metric=v.crash_class,
        step=report.step,
        rank=report.rank,
        severity="info",
        message=(
            f"rank {report.rank} crashed after rank {cause.rank} ({cause.verdict.crash_class}): "
            f"a consequence, not a cause ({v.crash_class}: {v.evidence_line[:160]})"
        ),
        evidence=report.evidence() | {"role": "consequence", "cause_rank": cause.rank},
    )


def thread_finding(report: CrashReport) -> Finding:
    v = report.verdict
    return Finding(
        detector=CRASH,
        metric=v.crash_class,
        step=report.step,
        rank=report.rank,
        severity="warning",
        message=(
            f"a thread of rank {report.rank} died: {v.crash_class} ({v.evidence_line[:200]}); "
            "the process goes on"
        ),
        evidence=report.evidence() | {"role": "thread"},
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
