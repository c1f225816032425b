"""Was the host busier when the run got slower? Contention evidence for throughput and data-wait findings.

Heartbeats carry ``host_load`` (producer/runwatch/producer/instrument/heartbeat.py): the 1-minute load average
and CPU count, and over the period since the previous beat the hypervisor's steal share, this process's CPU
share and its run-queue wait (seconds its threads were runnable but had no CPU, per wall second). A
``HostLoadTracker`` per rank keeps them by the heartbeat's step (each heartbeat's period spans the steps since
the previous one). When a throughput or data-wait finding names its onset step, the tracker compares the
heartbeats before the onset (the median of the last ``BASELINE_SAMPLES``) with those whose period lies mostly
after it (at least half of its steps at or after the onset; the median, and the latest load average, which is
already a 1-minute average), and says whether the host got busier. The finding is emitted either way
(attribution, not suppression).

**Busier**, by a fixed rule (any one of):

- ``load``: the load average per CPU rose by >= 0.5 and to >= 1.5x its level before;
- ``steal``: the steal share rose by >= 0.1 (the hypervisor gave the VM's CPUs to someone else);
- ``cpu_wait``: this process's run-queue wait rose by >= 0.25 s per second and to >= 1.5x its
  level before (its threads wanted a CPU and another process had it).

This process's own CPU share is reported but decides nothing: it falls just as much when the run
slows down by its own doing (a sleep, I/O, a lock), so it cannot tell a neighbour from a regression.

**Waiting for the evidence.** A slowdown is often found within a few steps, before any heartbeat
has measured the slow steps. While the rank's heartbeats carry host load, a finding is held
(``attribute`` returns nothing) until heartbeats since its onset cover ``MIN_AFTER_S`` (1 s: one
heartbeat at the default 5 s period, four at 0.25 s), at most ``HOLD_PERIODS`` (2.5) heartbeat
periods + 1 s of event time (judged at the rank's next event), or until the run ends
(``release_all``); then it is emitted with what is known. A rank whose heartbeats carry no
host load (an older producer, a simulated clock) holds nothing and gets no ``host_load`` evidence.
With no sample on one side of the onset, ``busier`` is None and the message makes no claim.

Pure: no clock (event time only), no I/O; state pickles.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.producer.wire.schema import HeartbeatEvent, RunEndEvent, StepEvent, TelemetryEvent

HISTORY = 256  # heartbeats remembered per rank
BASELINE_SAMPLES = 12  # the "before" median's samples: the last ones before the onset
AFTER_SHARE = 0.5  # a heartbeat counts as "since the onset" when this share of its period's steps is
MIN_AFTER_S = 1.0  # a held finding waits for heartbeats since its onset covering this much time (one, at 5 s)
HOLD_PERIODS = 2.5  # and at most this many heartbeat periods (plus MIN_AFTER_S) of event time
DEFAULT_INTERVAL_S = 5.0  # the period assumed when heartbeats do not say theirs
LOAD_PER_CPU_RISE = 0.5
LOAD_RATIO = 1.5
STEAL_RISE = 0.1
CPU_WAIT_RISE = 0.25
CPU_WAIT_RATIO = 1.5

_SHARES = ("steal_frac", "process_cpu_frac", "cpu_wait_frac")


@dataclass(frozen=True)
class _Sample:
    step: int  # the last step completed when the heartbeat was sent (-1: none yet)
    prev_step: int | None  # the previous sample's: the period spans the steps in between
    figures: dict[str, Any]
    period_s: float  # event time since the previous sample (its declared interval for the first)

    def share_after(self, onset: int) -> float:
        """The share of this heartbeat's period spent at or after step ``onset``, counted in steps."""
        if self.prev_step is None:
            return 1.0 if self.step >= onset else 0.0
        return min(1.0, max(0, self.step - onset + 1) / max(1, self.step - self.prev_step))


def _median(figures: list[dict[str, Any]], name: str) -> float | None:
    values = [f[name] for f in figures if f.get(name) is not None]
    return float(statistics.median(values)) if values else None


def _latest(figures: list[dict[str, Any]], name: str) -> Any:
    return next((f[name] for f in reversed(figures) if f.get(name) is not None), None)


def summarize(samples: list[_Sample], *, latest_load: bool) -> dict[str, Any]:
    """One side of the comparison: the load average (the latest, or the median), the CPU count and
    the medians of the period shares, with how many heartbeats and which steps they span."""
    figures = [s.figures for s in samples]
    out: dict[str, Any] = {
        "load1": _latest(figures, "load1") if latest_load else _median(figures, "load1"),
        "cpus": _latest(figures, "cpus"),
    }
    for name in _SHARES:
        out[name] = _median(figures, name)
    out = {k: v for k, v in out.items() if v is not None}
    out.update(samples=len(samples), first_step=samples[0].step, last_step=samples[-1].step)
    return out


def _per_cpu(side: dict[str, Any]) -> float | None:
    load, cpus = side.get("load1"), side.get("cpus")
    return load / cpus if load is not None and cpus else None


def busier_reasons(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Which parts of the rule (module doc) say the host got busier from ``before`` to ``now``."""
    reasons = []
    b, n = _per_cpu(before), _per_cpu(now)
    if b is not None and n is not None and n - b >= LOAD_PER_CPU_RISE and n >= LOAD_RATIO * b:
        reasons.append("load")
    b, n = before.get("steal_frac"), now.get("steal_frac")
    if b is not None and n is not None and n - b >= STEAL_RISE:
        reasons.append("steal")
    b, n = before.get("cpu_wait_frac"), now.get("cpu_wait_frac")
    if b is not None and n is not None and n - b >= CPU_WAIT_RISE and n >= CPU_WAIT_RATIO * b:
        reasons.append("cpu_wait")
    return reasons


def _comparable(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether any figure of the rule is known on both sides."""
    return (_per_cpu(before) is not None and _per_cpu(now) is not None) or any(
        before.get(k) is not None and now.get(k) is not None for k in ("steal_frac", "cpu_wait_frac")
    )


@dataclass(frozen=True)
class _Held:
    finding: Finding
    onset: int | None
    until: datetime  # event time after which it goes out with what is known


class HostLoadTracker:
    """One rank's heartbeats' host load, by step, and the findings waiting for it.

    ``observe`` every event of the rank (returns held findings now due); ``attribute`` a finding
    (returns it with the evidence, or nothing while it is held); ``release_all`` at the run's end."""

    def __init__(self) -> None:
        self._samples: deque[_Sample] = deque(maxlen=HISTORY)
        self._held: list[_Held] = []
        self._interval_s = DEFAULT_INTERVAL_S
        self._last_ts: datetime | None = None  # of the newest sample

    def observe(self, event: TelemetryEvent) -> list[Finding]:
        if isinstance(event, HeartbeatEvent):
            if event.interval_s is not None:
                self._interval_s = event.interval_s
            if event.host_load is not None:
                figures = {
                    k: v
                    for k, v in event.host_load.model_dump(exclude_none=True).items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
                if figures:
                    last = self._samples[-1] if self._samples else None
                    period = (
                        (event.ts - self._last_ts).total_seconds()
                        if self._last_ts is not None
                        else self._interval_s
                    )
                    self._samples.append(
                        _Sample(
                            -1 if event.step is None else event.step,
                            last.step if last is not None else None,
                            figures,
                            max(0.0, period),
                        )
                    )
                    self._last_ts = event.ts
        if not self._held:
            return []
        due, kept = [], []
        for held in self._held:
            if event.ts >= held.until or self._covered_since(held.onset) >= MIN_AFTER_S:
                due.append(_annotated(held.finding, self.evidence(held.onset)))
            else:
                kept.append(held)
        self._held = kept
        return due

    def _after(self, onset_step: int) -> list[_Sample]:
        """The heartbeats whose period lies mostly at or after ``onset_step``."""
        return [s for s in self._samples if s.step >= onset_step and s.share_after(onset_step) >= AFTER_SHARE]

    def _covered_since(self, onset_step: int | None) -> float:
        return 0.0 if onset_step is None else sum(s.period_s for s in self._after(onset_step))

    def attribute(self, finding: Finding, onset_step: int | None, now: datetime) -> list[Finding]:
        """``[finding]`` with ``evidence["host_load"]`` and the message's clause; ``[]`` while it waits
        for a heartbeat since ``onset_step`` (then ``observe`` returns it)."""
        evidence = self.evidence(onset_step)
        if (
            evidence is not None
            and evidence["before"] is not None
            and onset_step is not None
            and self._covered_since(onset_step) < MIN_AFTER_S
        ):
            wait = HOLD_PERIODS * self._interval_s + MIN_AFTER_S
            self._held.append(_Held(finding, onset_step, now + timedelta(seconds=wait)))
            return []
        return [_annotated(finding, evidence)]

    def release_all(self) -> list[Finding]:
        """Every held finding, with what is known (the run ends: no heartbeat is coming)."""
        held, self._held = self._held, []
        return [_annotated(h.finding, self.evidence(h.onset)) for h in held]

    @property
    def holding(self) -> int:
        return len(self._held)

    def evidence(self, onset_step: int | None) -> dict[str, Any] | None:
        """``{"before", "now", "busier"[, "reasons"]}`` around ``onset_step``; None without any sample."""
        if not self._samples:
            return None
        samples = list(self._samples)
        if onset_step is None:
            before_all, after = samples[:-1], samples[-1:]
        else:
            before_all = [s for s in samples if s.step < onset_step]
            after = self._after(onset_step)
        before = before_all[-BASELINE_SAMPLES:]
        result: dict[str, Any] = {
            "before": summarize(before, latest_load=False) if before else None,
            "now": summarize(after, latest_load=True) if after else None,
            "busier": None,
        }
        if before and after and _comparable(result["before"], result["now"]):
            reasons = busier_reasons(result["before"], result["now"])
            result["busier"] = bool(reasons)
            result["reasons"] = reasons
        return result


def describe(evidence: dict[str, Any] | None) -> str:
    """The message's clause for ``evidence`` (``"; host busier at the same step: load 1.0 → 3.4 ..."``),
    or "" for no claim."""
    if not evidence or evidence.get("busier") is None:
        return ""
    before, now = evidence["before"], evidence["now"]
    cpus = now.get("cpus") or before.get("cpus")
    on = f" on {cpus} CPUs" if cpus else ""
    b_load, n_load = before.get("load1"), now.get("load1")
    load = f"{b_load:.1f} → {n_load:.1f}{on}" if b_load is not None and n_load is not None else None
    if not evidence["busier"]:
        return f"; host load unchanged ({load})" if load else "; host not busier"
    reasons = evidence.get("reasons", [])
    parts = []
    if load and "load" in reasons:
        parts.append(f"load {load}")
    if "cpu_wait" in reasons:
        parts.append(
            f"this process waited for a CPU {before['cpu_wait_frac']:.0%} → {now['cpu_wait_frac']:.0%} "
            "of the time"
        )
    if "steal" in reasons:
        parts.append(f"CPU steal {before['steal_frac']:.0%} → {now['steal_frac']:.0%}")
    if load and "load" not in reasons:
        parts.append(f"load {load}")
    return "; host busier at the same step: " + ", ".join(parts)


def _annotated(finding: Finding, evidence: dict[str, Any] | None) -> Finding:
    if evidence is None:
        return finding
    return replace(
        finding,
        message=finding.message + describe(evidence),
        evidence={**finding.evidence, "host_load": evidence},
    )


def annotate(tracker: HostLoadTracker, finding: Finding, onset_step: int | None = None) -> Finding:
    """``finding`` with ``evidence["host_load"]`` as known now (no waiting). The onset: ``onset_step``,
    else the finding's ``evidence["onset_step"]``, else its step."""
    onset = onset_step if onset_step is not None else finding.evidence.get("onset_step", finding.step)
    return _annotated(finding, tracker.evidence(onset))


class HostLoadAttributed(Detector):
    """A step-time detector whose findings say whether the host got busier at their onset (throughput,
    data wait): ``find`` judges a step event and returns a finding with its onset step; this holds the
    finding until heartbeats have measured the host over the slow steps (``HostLoadTracker``)."""

    host_load: HostLoadTracker

    def find(self, event: StepEvent) -> tuple[Finding, int | None] | None:
        raise NotImplementedError

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, RunEndEvent):  # no heartbeat is coming: what waits goes out as it is
            return self.host_load.release_all()
        released = self.host_load.observe(event)  # findings that waited for a heartbeat's host load
        found = self.find(event) if isinstance(event, StepEvent) else None
        if found is None:
            return released
        finding, onset = found
        return released + self.host_load.attribute(finding, onset, now)
