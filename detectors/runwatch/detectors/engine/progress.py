"""Every rank's progress, kept once per run: what the liveness checks read.

``RankProgress`` is what one rank has shown of being alive and moving: its last completed step and
when the step last moved, its latest heartbeat (phase, when that phase began, whether it waits in
the gradient synchronisation, the heartbeat period it declares), when it was last heard at all,
and the pace of its steps. ``RunProgress`` keeps one per rank, the run's pace pooled over its
ranks, and each rank's peer allowance. The run's monitor owns it and feeds it each rank's events
before its detectors see them; the stall detector (per rank) and the hung-rank detector (across
ranks) read it. A liveness detector running alone (a test, the conformance suite) keeps one of its
own and feeds it itself.

Progress is the step moving: a step event (or a heartbeat's ``step``, the last completed step)
with a step beyond the current one; a step event going *back* (a rollback, a resume from a
checkpoint) counts as movement too. ``moves`` counts the movements and ``heard`` the events, so a
detector re-arms an episode by remembering the count it fired at. The pace is the rolling median of
step intervals from step event timestamps (river ``RollingQuantile`` over the last 100), the rank's
own and the run's (every rank's intervals in arrival order).

Peer allowance: in lockstep training every rank waits while one saves a checkpoint or evaluates,
and that is no stall of the waiting ranks. So each rank may take the largest phase allowance among
its live peers (heard from by heartbeat within their silence timeout), re-judged on every heartbeat
and every tick; when that allowance drops (the peer's long phase ended), ``peer_released_at`` says
when, and the ranks that waited count their own allowance from then.

Stacks: a rank's ``evidence`` event (the Python stacks its heartbeat thread captured once its step stopped)
is kept as ``stack``, a bounded summary (engine/evidence.py), until its step moves again; one about an
earlier step than the rank's is stale and dropped.

GPU health: a rank whose heartbeats carry ``gpu`` (NVML's figures) keeps them in ``gpu``, a
``GpuHealthTracker`` (gpu_health.py: the latest sample and since when each throttle reason is active), for
the ``hung_rank`` finding's evidence.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Protocol

from river import stats

from runwatch.contract.schema import HeartbeatEvent, StackEvidenceEvent, StepEvent, TelemetryEvent
from runwatch.detectors.engine.evidence import summarize
from runwatch.detectors.gpu_health import GpuHealthTracker

INTERVAL_WINDOW = 100  # step intervals in a rolling median


class Liveness(Protocol):
    """The liveness settings the tracker needs (the stall detector's config has them)."""

    @property
    def phase_allowance_s(self) -> dict[str, float]: ...

    def silent_after_s(self, heartbeat_interval_s: float | None) -> float: ...


class RankProgress:
    """One rank's progress and liveness (see the module doc)."""

    # The latest stack evidence since the step last moved (engine/evidence.py's summary; a class default: a
    # progress pickled before it reads None)
    stack: dict[str, Any] | None = None
    # Its GPU health, once a heartbeat carries ``gpu`` (gpu_health.py; a class default likewise)
    gpu: GpuHealthTracker | None = None

    def __init__(self, rank: int):
        self.rank = rank
        self.step: int | None = None  # the last completed step
        self.progress_at: datetime | None = None  # when the step last moved
        self.moves = 0
        self.heard_at: datetime | None = None  # the latest event of any kind
        self.heard = 0
        self.heartbeats = 0
        self.first_heartbeat_at: datetime | None = None
        self.heartbeat_at: datetime | None = None  # the latest heartbeat
        self.heartbeat_interval_s: float | None = None  # the producer's period, from its heartbeats
        self.phase = "train"  # the latest heartbeat's
        # When the current phase began as its heartbeats report it: an eval, checkpoint or data wait
        # time_in_phase_s before the heartbeat that first reported it; a resumed train phase at that
        # heartbeat. None while the rank is in the train phase it started in.
        self.phase_since: datetime | None = None
        self.in_sync: bool | None = (
            None  # waits in the gradient synchronisation (latest heartbeat, this step)
        )
        self.in_sync_since: datetime | None = None  # the heartbeat that first said so, this step
        self.peer_allowance_s = 0.0  # the largest phase allowance among its live peers
        self.peer_released_at: datetime | None = None  # when that allowance last dropped
        self._last_step_event: tuple[int, datetime] | None = None
        self._intervals = stats.RollingQuantile(q=0.5, window_size=INTERVAL_WINDOW)
        self.intervals_seen = 0

    def median_interval_s(self, min_steps: int) -> float | None:
        """The rank's median step interval, once ``min_steps`` intervals are known."""
        return self._intervals.get() if self.intervals_seen >= min_steps else None

    def phase_reported_at(self) -> datetime | None:
        """When the current phase was first reported: its start, or the first heartbeat for the train
        phase the rank started in."""
        return self.phase_since if self.phase_since is not None else self.first_heartbeat_at

    def observe(self, event: TelemetryEvent) -> float | None:
        """Take one of the rank's events; returns the step interval it measured, if any."""
        if self.heard_at is None or event.ts > self.heard_at:
            self.heard_at = event.ts
        self.heard += 1
        if isinstance(event, StepEvent):
            return self._step_event(event)
        if isinstance(event, HeartbeatEvent):
            self._heartbeat(event)
        elif isinstance(event, StackEvidenceEvent):
            self._evidence(event)
        return None

    def _evidence(self, event: StackEvidenceEvent) -> None:
        if event.step is not None and self.step is not None and event.step < self.step:
            return  # about a step the rank has moved on from
        self.stack = summarize(event)

    def _step_event(self, event: StepEvent) -> float | None:
        previous = self._last_step_event
        interval = None
        if previous is not None and event.step > previous[0]:
            dt = (event.ts - previous[1]).total_seconds() / (event.step - previous[0])
            if dt >= 0:
                self._intervals.update(dt)
                self.intervals_seen += 1
                interval = dt
        if previous is None or event.step != previous[0]:
            self._last_step_event = (event.step, event.ts)
        if self.step is None or event.step > self.step or (previous is not None and event.step < previous[0]):
            self._progress(event.step, event.ts)
        self.in_sync = None  # a new step: not waiting for anything yet
        self.in_sync_since = None
        return interval

    def _heartbeat(self, event: HeartbeatEvent) -> None:
        self.heartbeats += 1
        if event.gpu is not None:
            if self.gpu is None:
                self.gpu = GpuHealthTracker()
            self.gpu.observe(event)
        if self.first_heartbeat_at is None:
            self.first_heartbeat_at = event.ts
        if event.phase != self.phase:  # staying in a phase keeps its start
            self.phase_since = (
                event.ts if event.phase == "train" else event.ts - timedelta(seconds=event.time_in_phase_s)
            )
        self.phase = event.phase
        if self.heartbeat_at is None or event.ts > self.heartbeat_at:
            if event.in_sync is not True:
                self.in_sync_since = None
            elif self.in_sync is not True:
                # it began to wait after the last heartbeat that did not say so, and after its step's start
                bounds = [t for t in (self.heartbeat_at, self.progress_at) if t is not None]
                self.in_sync_since = max(bounds) if bounds else event.ts
            self.heartbeat_at = event.ts
            self.in_sync = event.in_sync
            if event.interval_s is not None:
                self.heartbeat_interval_s = event.interval_s
        if event.step is not None and (self.step is None or event.step > self.step):
            self._progress(event.step, event.ts)

    def _progress(self, step: int, ts: datetime) -> None:
        self.step = step
        self.stack = None  # (what it was doing while stuck is history)
        if self.progress_at is None or ts > self.progress_at:
            self.progress_at = ts
        self.moves += 1

    def share_peer_allowance(self, allowance_s: float, now: datetime) -> None:
        if allowance_s < self.peer_allowance_s:
            self.peer_released_at = now
        self.peer_allowance_s = allowance_s


class RunProgress:
    """Every rank's ``RankProgress`` in one run. ``observe`` each rank event in order; ``tick`` on a timer."""

    def __init__(self, liveness: Liveness):
        self.liveness = liveness
        self.ranks: dict[int, RankProgress] = {}
        self._intervals = stats.RollingQuantile(q=0.5, window_size=INTERVAL_WINDOW)
        self.intervals_seen = 0

    def rank(self, rank: int) -> RankProgress:
        progress = self.ranks.get(rank)
        if progress is None:
            progress = self.ranks[rank] = RankProgress(rank)
        return progress

    def observe(self, event: TelemetryEvent) -> None:
        progress = self.ranks.get(event.rank)  # (the rank's, looked up here: this runs on every event)
        if progress is None:
            progress = self.rank(event.rank)
        interval = progress.observe(event)
        if interval is not None:
            self._intervals.update(interval)
            self.intervals_seen += 1
        if isinstance(event, HeartbeatEvent):
            self._share_peer_phases(event.ts)

    def tick(self, now: datetime) -> None:
        self._share_peer_phases(now)

    def median_interval_s(self, min_steps: int) -> float | None:
        """The run's median step interval over every rank's, once ``min_steps`` intervals are known."""
        return self._intervals.get() if self.intervals_seen >= min_steps else None

    def silent_after_s(self, rank: RankProgress) -> float:
        """How long ``rank`` may go unheard before it is silent (dead)."""
        return self.liveness.silent_after_s(rank.heartbeat_interval_s)

    def live(self, now: datetime) -> dict[int, RankProgress]:
        """The ranks heard within their silence timeout that have a step."""
        return {
            r: p
            for r, p in self.ranks.items()
            if p.heard_at is not None
            and p.step is not None
            and (now - p.heard_at).total_seconds() <= self.silent_after_s(p)
        }

    def _share_peer_phases(self, now: datetime) -> None:
        """Give each rank the largest phase allowance among its peers whose heartbeat is live."""
        beating = [p for p in self.ranks.values() if p.heartbeat_at is not None]
        if len(beating) < 2:
            return
        allowances = self.liveness.phase_allowance_s
        # The two largest allowances: each rank's peers' largest is the first, or the second for
        # the rank that holds the first (linear in the ranks, on every heartbeat).
        top = sorted(
            (
                (allowances.get(p.phase, 0.0), p.rank)
                for p in beating
                if p.heartbeat_at is not None
                and (now - p.heartbeat_at).total_seconds() <= self.silent_after_s(p)
            ),
            reverse=True,
        )[:2]
        for progress in self.ranks.values():
            peers = [a for a, r in top if r != progress.rank]
            progress.share_peer_allowance(peers[0] if peers else 0.0, now)
