"""A hung rank: its heartbeat goes on, its step does not move, and its peers advance or wait on it.

The per-rank ``stall`` detector sees one rank alone; in lockstep training a hang on one rank
stalls every rank, so that alone cannot say *which* rank hangs. This detector looks across the
run's ranks, on ``tick(now)``:

- **behind**: the rank's last completed step is behind another live rank's, and it has made no
  progress for longer than allowed (ranks that do not synchronise every step keep going), and has
  been seen behind for longer than allowed too (in lockstep, after a pause every rank sat out, the
  first ranks to report the next step are ahead of the others only for a moment);
- **peers_waiting**: every other live rank is at the same step and reports ``in_sync`` (it has
  launched its gradient synchronisation and waits; the producer's DDP comm hook measures it),
  while this rank does not, for longer than allowed, and the peers have all waited that long.

Allowed: ``max(floor_s, factor x the run's median step interval + phase_allowance_s[phase])``,
with the phase of the rank's latest heartbeat (a rank saving a checkpoint for 5 minutes while its
peers wait is not hung), counted from its last progress or the start of that phase, whichever is
later. The ranks' steps, phases and heartbeats are their ``RankProgress`` (engine/progress.py), and the
median is the run's pace there, pooled over every rank's step intervals; nothing fires before
``min_steps`` intervals. Only ranks with a heartbeat since their last progress count (one that
stops beating is the stall detector's ``silent``: dead), and a rank is live while it was heard
within the stall detector's silence timeout for it (``RunProgress.live``). One finding per rank per
episode; progress re-arms it.

Stacks (engine/evidence.py): where a rank sent its Python stacks since its step stopped, they say whether
it waits for its peers where they can (its training thread inside ``torch.distributed``: it does; anywhere
but there and autograd: it does not, whatever ``in_sync`` says), so a hang before an explicit collective is
found as one in the gradient sync is. The finding carries every rank's stack summary (``evidence.stacks``,
``evidence.waits_in``) and its message names the hung rank's frame and what its peers wait in.

GPU health (gpu_health.py): where the hung rank's heartbeats carry ``gpu``, the finding carries its latest
sample and the throttle reasons active with their since-times (``evidence.gpu``), and the message says so
("rank 2: thermal throttle since 12:04:11 (SM clock 1110 of 1980 MHz)").
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import JoinedStep, RunEndEvent, TelemetryEvent
from runwatch.detectors.base import CrossRankDetector
from runwatch.detectors.engine.evidence import stack_waits, stacks_evidence, waits_phrase
from runwatch.detectors.engine.progress import RankProgress, RunProgress
from runwatch.detectors.findings import Finding
from runwatch.detectors.gpu_health import attach
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.stall import StallConfig


class HungRankConfig(Strict):
    """A rank that stops stepping while its heartbeat goes on, when its peers advance or wait on it."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=1, description="hung after this many median step intervals ...")
    phase_allowance_s: dict[str, float] = Field(
        default_factory=lambda: {
            "train": 10.0,
            "dataload": 60.0,
            "eval": 900.0,
            "checkpoint": 900.0,
            "idle": 3600.0,
        },
        description="... plus this many seconds for the phase of the rank's latest heartbeat",
    )
    floor_s: float = Field(default=5.0, ge=0, description="and never sooner than this")
    min_steps: int = Field(default=5, ge=2, description="step intervals seen before the median is trusted")


NAME = "hung_rank"


class HungRankDetector(CrossRankDetector):
    """Across the ranks of one run (see the module doc), reading their ``RankProgress`` in ``progress``:
    the run's tracker that its monitor keeps and feeds; without one (running alone) it keeps its own,
    judging liveness by ``liveness``, and feeds it every event it is given."""

    name = NAME

    def __init__(self, config: HungRankConfig, liveness: StallConfig, progress: RunProgress | None = None):
        self.config = config
        self._feeds_progress = progress is None
        self.progress = RunProgress(liveness) if progress is None else progress
        self._fired_at: dict[int, int] = {}  # rank -> its ``moves`` when it was named: progress re-arms it
        self._behind_since: dict[
            int, tuple[int, datetime]
        ] = {}  # rank -> (its step, first tick it was behind)
        self.ended = False

    def update(self, event: TelemetryEvent | JoinedStep, now: datetime) -> list[Finding]:
        if isinstance(event, RunEndEvent):
            self.ended = True
        elif self._feeds_progress and not isinstance(event, JoinedStep):
            self.progress.observe(event)
        return []

    def median_interval_s(self) -> float | None:
        return self.progress.median_interval_s(self.config.min_steps)

    def allowed_s(self, phase: str) -> float | None:
        median = self.median_interval_s()
        if median is None:
            return None
        cfg = self.config
        return max(cfg.floor_s, cfg.factor * median + cfg.phase_allowance_s.get(phase, 0.0))

    def tick(self, now: datetime) -> list[Finding]:
        if self.ended:
            return []
        live = self.progress.live(now)
        if len(live) < 2:
            return []
        # Per tick, linear in the ranks: the two highest steps, and how many ranks wait in sync at each step.
        steps = {r: s.step for r, s in live.items() if s.step is not None}  # (every live rank has one)
        highest = sorted(((step, r) for r, step in steps.items()), reverse=True)[:2]
        waits = _sync_waits(live, steps, now)
        findings = []
        for rank, state in live.items():
            peer_top = next(step for step, r in highest if r != rank)
            self._track_behind(rank, steps[rank], peer_top, now)
            overdue = self._overdue(rank, state, now)
            if overdue is None:
                continue
            waited, allowed = overdue
            if peer_top > steps[rank]:
                kind = "behind"
                why = self._behind_why(rank, steps, peer_top, allowed, now)
            else:
                kind = "peers_waiting"
                why = _peers_waiting_why(rank, state, live, waits.get(steps[rank]), allowed, now)
            if why is None:
                continue
            self._fired_at[rank] = state.moves
            findings.append(self._finding(rank, state, live, kind, why, waited, allowed))
        return findings

    def _track_behind(self, rank: int, step: int, peer_top: int, now: datetime) -> None:
        """Note the first tick ``rank`` was seen behind at ``step`` (another live rank is at ``peer_top``)."""
        if peer_top <= step:
            self._behind_since.pop(rank, None)
        elif self._behind_since.get(rank, (None,))[0] != step:
            self._behind_since[rank] = (step, now)

    def _overdue(self, rank: int, state: RankProgress, now: datetime) -> tuple[float, float] | None:
        """``(seconds waited, seconds allowed)`` when ``rank``, not named yet in this episode and heard
        since its last progress, has made none for longer than its phase allows; else None."""
        if self._fired_at.get(rank) == state.moves or state.progress_at is None:
            return None
        if state.heartbeat_at is None or state.heartbeat_at <= state.progress_at:
            return None  # no heartbeat since its last step: nothing says it is alive and stuck
        allowed = self.allowed_s(state.phase)
        if allowed is None:
            return None
        start = state.progress_at if state.phase_since is None else max(state.progress_at, state.phase_since)
        waited = (now - start).total_seconds()
        if waited <= allowed:
            return None
        return waited, allowed

    def _behind_why(
        self, rank: int, steps: dict[int, int], peer_top: int, allowed: float, now: datetime
    ) -> str | None:
        """Why ``rank``, behind its peers, is hung; None while it has been behind for no longer than allowed
        (in lockstep, after a pause, the first ranks to report the next step are ahead only for a moment)."""
        if (now - self._behind_since[rank][1]).total_seconds() <= allowed:
            return None
        ahead = sorted(r for r, step in steps.items() if r != rank and step > steps[rank])
        return f"ranks {ahead} have moved on to step {peer_top}"

    def _finding(
        self,
        rank: int,
        state: RankProgress,
        live: dict[int, RankProgress],
        kind: str,
        why: str,
        waited: float,
        allowed: float,
    ) -> Finding:
        stacks = {r: p.stack for r, p in sorted(live.items())}
        where = waits_phrase(rank, stacks)
        finding = Finding(
            detector=NAME,
            metric="step_progress",
            step=state.step,
            rank=rank,
            severity="critical",
            message=(
                f"rank {rank} is hung: no step completed for {waited:.0f} s since step {state.step} while "
                f"its heartbeat continues, and {why} (phase {state.phase!r}; allowed {allowed:.0f} s)"
                + (f": {where}" if where else "")
            ),
            value=waited,
            threshold=allowed,
            score=waited / allowed if allowed else None,
            evidence={
                "kind": kind,
                "phase": state.phase,
                "last_step": state.step,
                "seconds_since_progress": waited,
                "allowed_s": allowed,
                "median_step_interval_s": self.median_interval_s(),
                "peer_steps": {str(r): s.step for r, s in sorted(live.items()) if r != rank},
                "in_sync": state.in_sync,
                **stacks_evidence(rank, stacks),
            },
        )
        return attach(finding, state.gpu.evidence(rank) if state.gpu is not None else None)


def _sync_waits(
    live: dict[int, RankProgress], steps: dict[int, int], now: datetime
) -> dict[int, tuple[int, datetime]]:
    """step -> (how many live ranks there wait in the gradient sync, when the last of them began to wait)."""
    waits: dict[int, tuple[int, datetime]] = {}
    for r, s in live.items():
        if waits_for_peers(s):
            # (a stack shows where it waits, not since when: from its last progress at the earliest)
            since = (s.in_sync_since if s.in_sync is True else s.progress_at) or s.heartbeat_at or now
            count, latest = waits.get(steps[r], (0, since))
            waits[steps[r]] = (count + 1, max(since, latest))
    return waits


def _peers_waiting_why(
    rank: int,
    state: RankProgress,
    live: dict[int, RankProgress],
    wait: tuple[int, datetime] | None,
    allowed: float,
    now: datetime,
) -> str | None:
    """Why ``rank`` is hung when every other live rank is at its step (``wait``: theirs, from
    :func:`_sync_waits`) and waits in the gradient sync while it does not; else None."""
    if waits_for_peers(state) or wait is None or wait[0] != len(live) - 1:
        return None
    # ... and they have waited for longer than allowed (time they spent on their own work, e.g. a peer's
    # long checkpoint, is not a hang)
    if (now - wait[1]).total_seconds() <= allowed:
        return None
    peers = sorted(r for r in live if r != rank)
    if all(stack_waits(live[r].stack) for r in peers):  # (their stacks are in torch.distributed)
        return f"ranks {peers} wait for it in a collective"
    return f"ranks {peers} wait for it in the gradient synchronisation"


def waits_for_peers(state: RankProgress) -> bool:
    """Whether a rank waits for its peers: its stack says so where it can (evidence.py), else its
    heartbeat's ``in_sync``."""
    verdict = stack_waits(state.stack)
    return state.in_sync is True if verdict is None else verdict


register(
    DetectorSpec(
        name=NAME,
        config=HungRankConfig,
        build=lambda d, progress=None: HungRankDetector(d.hung_rank, d.stall, progress),
        view="cross_rank",
        reads_progress=True,
        episodic=True,
        summary="a rank that stops stepping while its heartbeat goes on and its peers wait on it",
    )
)
