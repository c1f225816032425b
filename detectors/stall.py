"""A stalled rank (heartbeats keep coming, the step does not move) or a silent one (heartbeats stop).

Progress is the step moving: a step event (or a heartbeat's ``step``, the last completed step)
with a step beyond the current one; a step going *back* (a rollback, a resume from a checkpoint)
counts as movement too, so a rolled-back run is not judged stalled until it catches up. The
typical pace is the rolling median of step intervals from step event timestamps (river
``RollingQuantile`` over the last 100), trusted after ``min_steps`` steps.

Stalled: ``now - start > factor x median step interval + phase_allowance_s[phase]``, where the
phase is the latest heartbeat's, so a long checkpoint save or an eval is not a stall, and ``start``
is the last progress or the start of the current phase, whichever is later (an eval's start is its
heartbeat's time minus ``time_in_phase_s``; a resumed train phase counts from its first report, so
the first step after a long eval gets its ordinary allowance). The train phase's allowance (10 s
by default) must exceed the producer's heartbeat period (5 s), so that a pause that is really an
eval or a data wait is reported as such before its train allowance runs out; the producer also
beats at once when an eval, checkpoint or idle phase begins or ends. Silent: no event at all from
the rank for ``max(heartbeat_timeout_s, heartbeat_misses x its heartbeat period)`` (30 s, or 6
periods; the period is the heartbeats' ``interval_s``), armed by its first heartbeat: a producer
that sends none is never called silent. One finding per episode: a stall re-arms when the step
moves, silence when the rank is heard again.

Detection delay: with ``tick`` called at least every ``d`` seconds (and on each heartbeat, which
``update`` checks too), a stall is found within ``factor`` (3) x the median step interval plus the
phase allowance after it began, plus ``d``.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import Field
from river import stats

from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.producer.schema import HeartbeatEvent, RunEndEvent, StepEvent, TelemetryEvent
from runwatch.producer.wire.schema import Severity


class StallConfig(Strict):
    """Heartbeats go on but the step does not move (phase-aware), or heartbeats stop."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=1, description="stalled after this many median step intervals ...")
    min_steps: int = Field(default=10, ge=2, description="steps seen before the median interval is trusted")
    phase_allowance_s: dict[str, float] = Field(
        default_factory=lambda: {"train": 10.0, "dataload": 60.0, "eval": 900.0, "checkpoint": 900.0, "idle": 3600.0},
        description="... plus this many seconds for the phase of the latest heartbeat (train: more than the "
                    "producer's 5 s heartbeat period, so a pause is reported as an eval or data wait in time)",
    )
    heartbeat_timeout_s: float = Field(
        default=30.0, gt=0, description="no event at all for at least this long: the rank is silent (dead)"
    )
    heartbeat_misses: float = Field(
        default=6.0, gt=1, description="... or for this many of the rank's heartbeat periods (its heartbeats' "
                                       "interval_s), where that is longer"
    )

    def silent_after_s(self, heartbeat_interval_s: float | None) -> float:
        """How long a rank whose heartbeats come every ``heartbeat_interval_s`` may go unheard."""
        if heartbeat_interval_s is None:
            return self.heartbeat_timeout_s
        return max(self.heartbeat_timeout_s, self.heartbeat_misses * heartbeat_interval_s)


NAME = "stall"
INTERVAL_WINDOW = 100  # step intervals in the rolling median


class StallDetector(Detector):
    """Phase-aware stall and silence of one rank, checked on ``tick(now)`` (see the module doc)."""

    name = NAME

    def __init__(self, config: StallConfig):
        self.config = config
        self.rank: int | None = None
        self.step: int | None = None  # the current (last completed) step
        self.progress_at: datetime | None = None
        self._last_step_event: tuple[int, datetime] | None = None
        self._intervals = stats.RollingQuantile(q=0.5, window_size=INTERVAL_WINDOW)
        self.intervals_seen = 0
        self.phase = "train"
        self.phase_seen_at: datetime | None = None  # the first heartbeat that reported the current phase
        self.heard_at: datetime | None = None  # the latest event of any kind
        self.heartbeats = 0
        self.heartbeat_at: datetime | None = None
        self.heartbeat_interval_s: float | None = None  # the producer's period, from its heartbeats
        self.ended = False
        # Set by the run's monitor: the largest phase allowance among the live peers. In lockstep
        # training every rank waits while one saves a checkpoint or evaluates; that is no stall.
        self.peer_allowance_s = 0.0
        # When a peer's larger allowance last ended (its checkpoint or eval finished): the ranks that
        # waited for it count their own allowance from then, as a rank does after its own long phase.
        self.peer_released_at: datetime | None = None
        self._stall_fired = False
        self._silence_fired = False

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, RunEndEvent):
            self.ended = True
            return []
        self.rank = event.rank
        if self.heard_at is None or event.ts > self.heard_at:
            self.heard_at = event.ts
        self._silence_fired = False
        if isinstance(event, StepEvent):
            self._step_event(event)
            return []
        if isinstance(event, HeartbeatEvent):
            self.heartbeats += 1
            if event.phase != self.phase or self.phase_seen_at is None:
                # An eval, checkpoint or data wait started time_in_phase_s before this heartbeat; a
                # resumed train phase keeps its original start, so it counts from this report.
                self.phase_seen_at = (event.ts if event.phase == "train"
                                      else event.ts - timedelta(seconds=event.time_in_phase_s))
            self.phase = event.phase
            if self.heartbeat_at is None or event.ts > self.heartbeat_at:
                self.heartbeat_at = event.ts
                if event.interval_s is not None:
                    self.heartbeat_interval_s = event.interval_s
            if event.step is not None and (self.step is None or event.step > self.step):
                self._progress(event.step, event.ts)
            return self.tick(now)
        return []

    def _step_event(self, event: StepEvent) -> None:
        previous = self._last_step_event
        if previous is not None and event.step > previous[0]:
            dt = (event.ts - previous[1]).total_seconds() / (event.step - previous[0])
            if dt >= 0:
                self._intervals.update(dt)
                self.intervals_seen += 1
        if previous is None or event.step != previous[0]:
            self._last_step_event = (event.step, event.ts)
        if self.step is None or event.step > self.step or (previous is not None and event.step < previous[0]):
            self._progress(event.step, event.ts)

    def _progress(self, step: int, ts: datetime) -> None:
        self.step = step
        if self.progress_at is None or ts > self.progress_at:
            self.progress_at = ts
        self._stall_fired = False

    def median_interval_s(self) -> float | None:
        return self._intervals.get() if self.intervals_seen >= self.config.min_steps else None

    def set_peer_allowance(self, allowance_s: float, now: datetime) -> None:
        if allowance_s < self.peer_allowance_s:
            self.peer_released_at = now
        self.peer_allowance_s = allowance_s

    def allowance_s(self) -> float:
        """The phase allowance: this rank's phase's, or a peer's if larger (``peer_allowance_s``)."""
        return max(self.config.phase_allowance_s.get(self.phase, 0.0), self.peer_allowance_s)

    def allowed_s(self) -> float | None:
        median = self.median_interval_s()
        if median is None:
            return None
        return self.config.factor * median + self.allowance_s()

    def silent_after_s(self) -> float:
        return self.config.silent_after_s(self.heartbeat_interval_s)

    def tick(self, now: datetime) -> list[Finding]:
        if self.ended or self.heard_at is None:
            return []
        silent_s = (now - self.heard_at).total_seconds()
        if self.heartbeats and silent_s > self.silent_after_s():
            if self._silence_fired:
                return []
            self._silence_fired = True
            return [self._finding("silent", now, silent_s)]
        allowed = self.allowed_s()
        if allowed is None or self.progress_at is None or self._stall_fired:
            return []
        # The clock runs from the last progress or from when the current phase was first reported,
        # whichever is later: the first step after a long eval gets its normal time, not none.
        # (A peer's long phase that just ended counts as this rank's: it waited for that peer.)
        start = max(t for t in (self.progress_at, self.phase_seen_at, self.peer_released_at) if t is not None)
        if (now - start).total_seconds() <= allowed:
            return []
        if self.heartbeats and (self.heartbeat_at is None or self.heartbeat_at <= self.progress_at):
            # No heartbeat since the last step: the pause's phase is unknown, or heartbeats stopped
            # too (silence, below). The train allowance outlasts a heartbeat period, so this wait
            # does not delay finding a rank that hangs while it still beats.
            return []
        self._stall_fired = True
        return [self._finding("stalled", now, silent_s)]

    def _finding(self, kind: str, now: datetime, silent_s: float) -> Finding:
        cfg = self.config
        since = (now - self.progress_at).total_seconds() if self.progress_at is not None else None
        allowed = self.allowed_s()
        median = self.median_interval_s()
        allowance = self.allowance_s()
        severity: Severity
        value: float | None
        threshold: float | None
        if kind == "silent":
            timeout = self.silent_after_s()
            period = (f"; heartbeats every {self.heartbeat_interval_s:g} s" if self.heartbeat_interval_s is not None
                      else "")
            message = (f"rank {self.rank} has been silent for {silent_s:.0f} s (no heartbeat or event; timeout "
                       f"{timeout:.0f} s{period}): last step {self.step}, last phase {self.phase!r}")
            value, threshold, severity = silent_s, timeout, "critical"
        else:
            heard = "while heartbeats continue" if self.heartbeats else "(this rank sends no heartbeats)"
            message = (f"rank {self.rank} is stalled: no step completed for {since:.0f} s since step {self.step} "
                       f"{heard} (phase {self.phase!r}; allowed {allowed:.0f} s = {cfg.factor:g} x median step "
                       f"{median:.3g} s + {allowance:g} s for the phase)")
            value, threshold, severity = since, allowed, "warning"
        return Finding(
            detector=NAME,
            metric="heartbeat" if kind == "silent" else "step_progress",
            step=self.step,
            rank=self.rank,
            severity=severity,
            message=message,
            value=value,
            threshold=threshold,
            score=value / threshold if value is not None and threshold else None,
            evidence={
                "kind": kind,
                "phase": self.phase,
                "seconds_since_progress": since,
                "seconds_since_heard": silent_s,
                "allowed_s": allowed,
                "median_step_interval_s": median,
                "phase_allowance_s": allowance,
                "silent_after_s": self.silent_after_s(),
                "last_step": self.step,
            },
        )


register(DetectorSpec(
    name=NAME, config=StallConfig, build=lambda d: StallDetector(d.stall), view="rank", episodic=True,
    knob="factor", summary="heartbeats go on but the step does not move (phase-aware), or the heartbeats stop",
))
