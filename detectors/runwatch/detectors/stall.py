"""A stalled rank (heartbeats keep coming, the step does not move) or a silent one (heartbeats stop).

The rank's progress, heartbeats and pace are its ``RankProgress`` (engine/progress.py), kept once per
run by the monitor. Progress is the step moving; a step going *back* (a rollback, a resume from a
checkpoint) counts as movement too, so a rolled-back run is not judged stalled until it catches
up. The typical pace is the rank's rolling median step interval, trusted after ``min_steps`` steps.

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

Stacks: a stalled rank's finding carries the Python stacks it sent since its step stopped and its peers'
(``evidence.stacks``, ``evidence.waits_in``: engine/evidence.py), and its message says where it waits.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import HeartbeatEvent, RunEndEvent, Severity, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.engine.evidence import stacks_evidence, waits_phrase
from runwatch.detectors.engine.progress import RankProgress, RunProgress
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


class StallConfig(Strict):
    """Heartbeats go on but the step does not move (phase-aware), or heartbeats stop."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=1, description="stalled after this many median step intervals ...")
    min_steps: int = Field(default=10, ge=2, description="steps seen before the median interval is trusted")
    phase_allowance_s: dict[str, float] = Field(
        default_factory=lambda: {
            "train": 10.0,
            "dataload": 60.0,
            "eval": 900.0,
            "checkpoint": 900.0,
            "idle": 3600.0,
        },
        description="... plus this many seconds for the phase of the latest heartbeat (train: more than the "
        "producer's 5 s heartbeat period, so a pause is reported as an eval or data wait in time)",
    )
    heartbeat_timeout_s: float = Field(
        default=30.0, gt=0, description="no event at all for at least this long: the rank is silent (dead)"
    )
    heartbeat_misses: float = Field(
        default=6.0,
        gt=1,
        description="... or for this many of the rank's heartbeat periods (its heartbeats' "
        "interval_s), where that is longer",
    )

    def silent_after_s(self, heartbeat_interval_s: float | None) -> float:
        """How long a rank whose heartbeats come every ``heartbeat_interval_s`` may go unheard."""
        if heartbeat_interval_s is None:
            return self.heartbeat_timeout_s
        return max(self.heartbeat_timeout_s, self.heartbeat_misses * heartbeat_interval_s)


NAME = "stall"


class StallDetector(Detector):
    """Phase-aware stall and silence of one rank, checked on ``tick(now)`` (see the module doc).

    It reads the rank's ``RankProgress`` in ``progress``, the run's tracker that its monitor keeps and
    feeds; without one (running alone) it keeps its own and feeds it every event it is given."""

    name = NAME

    def __init__(self, config: StallConfig, progress: RunProgress | None = None):
        self.config = config
        self._feeds_progress = progress is None
        self.progress = RunProgress(config) if progress is None else progress
        self.rank: int | None = None
        self.ended = False
        # The rank's ``moves`` / ``heard`` counts when it last fired: an episode re-arms when the step
        # moves (a stall) or the rank is heard again (silence).
        self._stall_fired_at: int | None = None
        self._silence_fired_at: int | None = None

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, RunEndEvent):
            self.ended = True
            return []
        if self._feeds_progress:
            self.progress.observe(event)
        self.rank = event.rank
        return self.tick(now) if isinstance(event, HeartbeatEvent) else []

    def median_interval_s(self, rank: RankProgress) -> float | None:
        return rank.median_interval_s(self.config.min_steps)

    def allowance_s(self, rank: RankProgress) -> float:
        """The phase allowance: this rank's phase's, or a live peer's if larger."""
        return max(self.config.phase_allowance_s.get(rank.phase, 0.0), rank.peer_allowance_s)

    def allowed_s(self, rank: RankProgress) -> float | None:
        median = self.median_interval_s(rank)
        if median is None:
            return None
        return self.config.factor * median + self.allowance_s(rank)

    def tick(self, now: datetime) -> list[Finding]:
        if self.ended or self.rank is None:
            return []
        rank = self.progress.rank(self.rank)
        if rank.heard_at is None:
            return []
        silent_s = (now - rank.heard_at).total_seconds()
        if rank.heartbeats and silent_s > self.progress.silent_after_s(rank):
            if self._silence_fired_at == rank.heard:
                return []
            self._silence_fired_at = rank.heard
            return [self._finding(rank, "silent", now, silent_s)]
        allowed = self.allowed_s(rank)
        if allowed is None or rank.progress_at is None or self._stall_fired_at == rank.moves:
            return []
        # The clock runs from the last progress or from when the current phase was first reported,
        # whichever is later: the first step after a long eval gets its normal time, not none.
        # (A peer's long phase that just ended counts as this rank's: it waited for that peer.)
        start = max(
            t for t in (rank.progress_at, rank.phase_reported_at(), rank.peer_released_at) if t is not None
        )
        if (now - start).total_seconds() <= allowed:
            return []
        if rank.heartbeats and (rank.heartbeat_at is None or rank.heartbeat_at <= rank.progress_at):
            # No heartbeat since the last step: the pause's phase is unknown, or heartbeats stopped
            # too (silence, below). The train allowance outlasts a heartbeat period, so this wait
            # does not delay finding a rank that hangs while it still beats.
            return []
        self._stall_fired_at = rank.moves
        return [self._finding(rank, "stalled", now, silent_s)]

    def _finding(self, rank: RankProgress, kind: str, now: datetime, silent_s: float) -> Finding:
        cfg = self.config
        since = (now - rank.progress_at).total_seconds() if rank.progress_at is not None else None
        allowed = self.allowed_s(rank)
        median = self.median_interval_s(rank)
        allowance = self.allowance_s(rank)
        silent_after = self.progress.silent_after_s(rank)
        severity: Severity
        value: float | None
        threshold: float | None
        if kind == "silent":
            period = (
                f"; heartbeats every {rank.heartbeat_interval_s:g} s"
                if rank.heartbeat_interval_s is not None
                else ""
            )
            message = (
                f"rank {rank.rank} has been silent for {silent_s:.0f} s (no heartbeat or event; timeout "
                f"{silent_after:.0f} s{period}): last step {rank.step}, last phase {rank.phase!r}"
            )
            value, threshold, severity = silent_s, silent_after, "critical"
        else:
            heard = "while heartbeats continue" if rank.heartbeats else "(this rank sends no heartbeats)"
            message = (
                f"rank {rank.rank} is stalled: no step completed for {since:.0f} s since step {rank.step} "
                f"{heard} (phase {rank.phase!r}; allowed {allowed:.0f} s = {cfg.factor:g} x median step "
                f"{median:.3g} s + {allowance:g} s for the phase)"
            )
            value, threshold, severity = since, allowed, "warning"
        stacks = {r: p.stack for r, p in sorted(self.progress.ranks.items())} if kind == "stalled" else {}
        where = waits_phrase(rank.rank, stacks)
        if where:
            message += f": {where}"
        return Finding(
            detector=NAME,
            metric="heartbeat" if kind == "silent" else "step_progress",
            step=rank.step,
            rank=rank.rank,
            severity=severity,
            message=message,
            value=value,
            threshold=threshold,
            score=value / threshold if value is not None and threshold else None,
            evidence={
                "kind": kind,
                "phase": rank.phase,
                "seconds_since_progress": since,
                "seconds_since_heard": silent_s,
                "allowed_s": allowed,
                "median_step_interval_s": median,
                "phase_allowance_s": allowance,
                "silent_after_s": silent_after,
                "last_step": rank.step,
                **stacks_evidence(rank.rank, stacks),
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=StallConfig,
        build=lambda d, progress=None: StallDetector(d.stall, progress),
        view="rank",
        reads_progress=True,
        episodic=True,
        knob="factor",
        summary="heartbeats go on but the step does not move (phase-aware), or the heartbeats stop",
    )
)
