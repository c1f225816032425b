"""Was the host busier when the run got slower? Contention evidence for throughput and data-wait findings.

Heartbeats carry ``host_load`` (producer/runwatch/producer/instrument/heartbeat.py): the 1-minute load average
and CPU count, and over the period since the previous beat the hypervisor's steal share, this process's CPU
share and its run-queue wait (seconds its threads were runnable but had no CPU, per wall second). A
``HostLoadTracker`` per rank keeps them by the heartbeat's step (each heartbeat's period spans the steps since
the previous one). When a throughput or data-wait finding names its onset step, the tracker compares the
heartbeats before the onset (the median of the last ``BASELINE_SAMPLES``) with those whose period lies mostly
after it (at least half of its steps at or after the onset; the median, and the latest load average, which is
already a 1-minute average), and says whether the host got busier. A finding that judged the level of
its latest steps (``evidence["recent_from_step"]``: a creep, a slowdown found long after its onset) is
compared over those: "since" is then the heartbeats since that step (at least the latest since the onset).
The finding is emitted either way (attribution, not suppression; a detector may then name contention,
``HostLoadAttributed.attributed``).

**Busier**, by a fixed rule (any one of):

- ``load``: the load average per CPU rose by >= 0.5 and to >= 1.5x its level before;
- ``steal``: the steal share rose by >= 0.1 (the hypervisor gave the VM's CPUs to someone else);
- ``cpu_wait``: this process's run-queue wait rose by >= 0.25 s per second and to >= 1.5x its
  level before (its threads wanted a CPU and another process had it).

This process's own CPU share decides nothing on its own: it falls just as much when the run
slows down by its own doing (a sleep, I/O, a lock), so it cannot tell a neighbour from a regression.

**Saturated** (``evidence["saturated"]``, each side): the run competes for CPU time: this process's
run-queue wait is >= 0.25 s per second, or the steal share is >= 0.1; where its wait is not measured, the
load per CPU is >= ``SATURATED_LOAD_PER_CPU`` (1.0: every CPU has a runnable task). (A load of 1.1 per CPU
that leaves the run 90% of a CPU is not saturated for it.) The message says "host load unchanged, saturated
throughout (6.5 → 7.2 on 2 CPUs, 3.2 → 3.6 per CPU)" where it was saturated on both sides, never only
"unchanged": a load three times the cores is not a calm host.

**Contention** (``contention``, for a slowdown by a known factor): how much slower the host alone makes
the run (``explained``), by the largest of

- ``cpu_wait``: this process's CPU share fell from ``c0`` to ``c1`` and at least half of what it lost
  went to waiting for a CPU (its run-queue wait rose by >= half the fall): ``c0 / c1``;
- ``steal``: the steal share rose from ``s0`` to ``s1``: ``(1 - s0) / (1 - s1)``;
- ``load`` (only where this process's CPU share or run-queue wait is unknown): the fair share of the
  CPUs the load leaves a runnable thread, ``max(load1, cpus)`` after over before.

The slowdown is contention (``cause``) when the host explains at least half of the rise and leaves less
than the detector's tolerance (its ``min_change``) unexplained; otherwise it is the run's (``run``),
even on a saturated host (its CPU share held, or fell without waiting: more work per step, a sleep).

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

from runwatch.contract.schema import HeartbeatEvent, RunEndEvent, StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding

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
SATURATED_LOAD_PER_CPU = 1.0
SATURATED_STEAL = 0.1
SATURATED_CPU_WAIT = 0.25
LOST_TO_WAIT = 0.5  # of the CPU share this process lost, the part that must have gone to waiting for a CPU
MIN_EXPLAINED = 0.5  # of a slowdown's rise, the part the host must explain for contention
# On a saturated host, CPU time lost to waiting for a CPU or to steal (as a slowdown factor) from which a
# slowdown the host does not fully explain is not blamed on the run: its cause is unknown (issue 37)
MIN_LOST_TO_HOST = 1.1

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


def saturated(side: dict[str, Any] | None) -> bool | None:
    """Whether the host was saturated on this side (module doc); None where no figure of the rule is known."""
    if side is None:
        return None
    per_cpu, steal, wait = _per_cpu(side), side.get("steal_frac"), side.get("cpu_wait_frac")
    if per_cpu is None and steal is None and wait is None:
        return None
    if steal is not None and steal >= SATURATED_STEAL:
        return True
    if wait is not None:  # what the run itself gets, where measured
        return bool(wait >= SATURATED_CPU_WAIT)
    return per_cpu is not None and per_cpu >= SATURATED_LOAD_PER_CPU


def _known(before: dict[str, Any], now: dict[str, Any], name: str) -> tuple[float, float] | None:
    b, n = before.get(name), now.get(name)
    return (float(b), float(n)) if b is not None and n is not None else None


def explained_slowdown(before: dict[str, Any], now: dict[str, Any]) -> dict[str, float]:
    """By each figure of the contention rule (module doc) that says the host took CPU time from the run:
    how much slower that alone makes it (> 1)."""
    factors: dict[str, float] = {}
    cpu, wait = _known(before, now, "process_cpu_frac"), _known(before, now, "cpu_wait_frac")
    if cpu is not None and wait is not None and cpu[0] > cpu[1] > 0:
        if wait[1] - wait[0] >= LOST_TO_WAIT * (cpu[0] - cpu[1]):
            factors["cpu_wait"] = cpu[0] / cpu[1]
    steal = _known(before, now, "steal_frac")
    if steal is not None and steal[1] > steal[0] and steal[1] < 1:
        factors["steal"] = (1 - steal[0]) / (1 - steal[1])
    cpus = now.get("cpus") or before.get("cpus")
    load = _known(before, now, "load1")
    if (cpu is None or wait is None) and load is not None and cpus:
        fair = max(load[1], cpus) / max(load[0], cpus)
        if fair > 1:
            factors["load"] = fair
    return factors


def contention(evidence: dict[str, Any] | None, slowdown: float, tolerance: float) -> dict[str, Any] | None:
    """Whether the host explains a slowdown by ``slowdown`` (after over before), leaving less than
    ``tolerance`` (relative) unexplained (module doc): ``{"cause": "contention" | "unknown" | "run",
    "explained", "factors", "slowdown", "saturated_before", "saturated_now"}``; None with no comparable
    figures."""
    if not evidence or evidence.get("before") is None or evidence.get("now") is None:
        return None
    before, now = evidence["before"], evidence["now"]
    if not _comparable(before, now):
        return None
    factors = explained_slowdown(before, now)
    explained = max(factors.values(), default=1.0)
    shared = explained - 1 >= MIN_EXPLAINED * (slowdown - 1) and slowdown / explained < 1 + tolerance
    # On a saturated host where the run measurably lost CPU time to it (waiting for a CPU, or stolen) but
    # not all of the slowdown is explained, the rest cannot be told apart from the host's noise: the cause
    # is unknown, not the run (issue 37). A run whose CPU share did not drop is still the run's own.
    lost = max((factors[k] for k in ("cpu_wait", "steal") if k in factors), default=1.0)
    unknown = not shared and bool(saturated(now)) and lost >= MIN_LOST_TO_HOST
    return {
        "cause": "contention" if shared else "unknown" if unknown else "run",
        "explained": explained,
        "factors": factors,
        "slowdown": slowdown,
        "saturated_before": saturated(before),
        "saturated_now": saturated(now),
    }


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
                due.append(_annotated(held.finding, self._evidence_for(held.finding, held.onset)))
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
        evidence = self._evidence_for(finding, onset_step)
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
        return [_annotated(h.finding, self._evidence_for(h.finding, h.onset)) for h in held]

    @property
    def holding(self) -> int:
        return len(self._held)

    def _evidence_for(self, finding: Finding, onset_step: int | None) -> dict[str, Any] | None:
        return self.evidence(onset_step, finding.evidence.get("recent_from_step"))

    def evidence(self, onset_step: int | None, recent_step: int | None = None) -> dict[str, Any] | None:
        """``{"before", "now", "busier", "saturated"[, "reasons"]}`` around ``onset_step``; None without
        any sample. ``recent_step``: where the level a finding judged began (a finding's
        ``evidence["recent_from_step"]``, after a long slowdown or a creep): "now" is then the heartbeats
        since it (at least the latest since the onset), not every one since the onset."""
        if not self._samples:
            return None
        samples = list(self._samples)
        if onset_step is None:
            before_all, after = samples[:-1], samples[-1:]
        else:
            before_all = [s for s in samples if s.step < onset_step]
            after = self._after(onset_step)
            if recent_step is not None and recent_step > onset_step and after:
                after = [s for s in self._after(recent_step) if s in after] or after[-1:]
        before = before_all[-BASELINE_SAMPLES:]
        result: dict[str, Any] = {
            "before": summarize(before, latest_load=False) if before else None,
            "now": summarize(after, latest_load=True) if after else None,
            "busier": None,
        }
        result["saturated"] = {"before": saturated(result["before"]), "now": saturated(result["now"])}
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
        return _not_busier(evidence, load)
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


def _not_busier(evidence: dict[str, Any], load: str | None) -> str:
    """The clause for a host that did not get busier: never only "unchanged" where it was saturated on both
    sides (a load three times the cores is not a calm host)."""
    if not _saturated_throughout(evidence):
        return f"; host load unchanged ({load})" if load else "; host not busier"
    figures = ", ".join(f for f in (load, _per_cpu_change(evidence["before"], evidence["now"])) if f)
    return (
        f"; host load unchanged, saturated throughout ({figures})"
        if figures
        else "; host not busier, saturated"
    )


def _saturated_throughout(evidence: dict[str, Any]) -> bool:
    sides = evidence.get("saturated") or {}
    return bool(sides.get("before")) and bool(sides.get("now"))


def _per_cpu_change(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    b, n = _per_cpu(before), _per_cpu(now)
    return f"{b:.1f} → {n:.1f} per CPU" if b is not None and n is not None else None


def describe_contention(verdict: dict[str, Any], evidence: dict[str, Any]) -> str:
    """The message's clause for a contention verdict: how much of the slowdown the host explains, and by
    what (``"; the host explains x1.9 of the x2.0: this process's CPU share 95% → 50%, the rest waiting
    for a CPU"``)."""
    before, now, factors = evidence["before"], evidence["now"], verdict["factors"]
    if not factors:
        return "; the host explains none of it"
    by = max(factors, key=lambda name: factors[name])
    if by == "cpu_wait":
        why = (
            f"this process's CPU share {before['process_cpu_frac']:.0%} → {now['process_cpu_frac']:.0%}, "
            "the rest waiting for a CPU"
        )
    elif by == "steal":
        why = f"CPU steal {before['steal_frac']:.0%} → {now['steal_frac']:.0%}"
    else:
        why = f"its fair share of the CPUs at load {_per_cpu_change(before, now)}"
    return f"; the host explains x{verdict['explained']:.2f} of the x{verdict['slowdown']:.2f}: {why}"


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

    def attributed(self, finding: Finding) -> Finding:
        """The finding as it goes out, once its host-load evidence is known (a detector may name
        contention here); as it is by default."""
        return finding

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        found = self._update(event, now)
        # (most events find nothing: no second list, and no comprehension's call, for them)
        return [self.attributed(f) for f in found] if found else found

    def _update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, RunEndEvent):  # no heartbeat is coming: what waits goes out as it is
            return self.host_load.release_all()
        released = self.host_load.observe(event)  # findings that waited for a heartbeat's host load
        found = self.find(event) if isinstance(event, StepEvent) else None
        if found is None:
            return released
        finding, onset = found
        return released + self.host_load.attribute(finding, onset, now)
