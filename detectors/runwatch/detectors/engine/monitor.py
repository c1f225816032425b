"""``RunMonitor``: all detector and policy state of one run, fed one event at a time.

It runs inside the Faust worker and takes no I/O and no clock (event timestamps are its
only time), so the same code can replay a recorded stream offline. Its state pickles.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypedDict, cast

from runwatch.contract.group_report import ReportItem
from runwatch.contract.schema import (
    ActionAckEvent,
    Anomaly,
    CheckpointEvent,
    CheckpointRef,
    CrashEvent,
    EvalEvent,
    HeartbeatEvent,
    JoinedStep,
    RunEndEvent,
    RunStartEvent,
    StackEvidenceEvent,
    StepEvent,
    TelemetryEvent,
)
from runwatch.detectors import registry
from runwatch.detectors.base import CrossRankDetector, Detector
from runwatch.detectors.baselines.gate import RunEndBaselineCheck
from runwatch.detectors.baselines.summary import RunSummary
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.ack_watch import AckWatch
from runwatch.detectors.engine.checkpoints import CheckpointLedger
from runwatch.detectors.engine.crashes import (
    CrashHistory,
    CrashReport,
    CrashWatch,
    cause_finding,
    consequence_finding,
    thread_finding,
)
from runwatch.detectors.engine.policy import EPISODIC_DETECTORS, ActionDecision, ActionPolicy, decision_id
from runwatch.detectors.engine.progress import RunProgress
from runwatch.detectors.engine.rank_join import Joined, StepJoin
from runwatch.detectors.engine.recovery import RECOVERED, RecoveryCheck
from runwatch.detectors.engine.rewind import DetectorSnapshots
from runwatch.detectors.findings import Finding

_ANOMALY_NAMESPACE = uuid.UUID("0b8f3c4e-2a71-4d3e-8f5a-7c9e1d2b6a40")


RECENT_EVENT_IDS = 4096  # event ids remembered per run, to drop a redelivered event
ISSUED_ONSETS = 1024  # alert-level findings remembered per run by onset, so a replay does not repeat them
CLOCK_SKEW = "clock_skew"  # the finding about a rank whose clock is ahead of the worker's (clock_seen)
MAX_CLOCK_RANKS = 64  # ranks whose clock offsets a run's actions carry at most
LOSS_HISTORY = 1024  # joined steps' losses kept per run: a rollback's recovery is judged against them
# These bounded memories are ordered dicts, not plain ones: dropping a plain dict's oldest key with
# next(iter(d)) walks over every slot its earlier deletions left empty (hundreds, until the dict is next
# resized), which cost ~1 µs per event with LOSS_HISTORY full and ~2 µs with RECENT_EVENT_IDS full;
# an ordered dict's popitem(last=False) drops it at once.


@dataclass
class MonitorOutput:
    anomalies: list[Anomaly] = field(default_factory=list)
    decisions: list[ActionDecision] = field(default_factory=list)
    joined: list[JoinedStep] = field(default_factory=list)  # multi-rank runs' joined steps
    # Findings not issued because one for the same onset was (a replay after a rollback): not published
    repeated: list[Finding] = field(default_factory=list)
    # A rank group's items for the worker that merges its split run (group_monitor.py): steps as partials,
    # findings for the run's policy, run-level events
    report: list[ReportItem] = field(default_factory=list)


@dataclass
class RunLedger:
    """What a run keeps when a worker lets it go without its end (silence, eviction) or drops a snapshot
    of another log: enough for it to come back able to roll back, a few hundred bytes. Its checkpoints
    (confirmed-good and pending), the rollbacks it has spent and whether it was stopped (a run let go
    and back has no fresh budget), its attempt, job and world size (actions name the attempt; a
    remediator reads the job). A fresh monitor takes it on with ``RunMonitor.take_ledger``."""

    attempt: str | None
    started: bool
    job: dict[str, str]
    world_size: int
    good: list[CheckpointRef]
    pending: list[CheckpointRef]
    rollbacks: int
    stopped: bool


class _RewindState(TypedDict):
    """The step-indexed detectors' state, as snapshotted at a checkpoint (the rank ones by position)."""

    joined: list[Detector]
    ranks: dict[int, dict[int, Detector]]


def _builder(spec: registry.DetectorSpec) -> Callable[[RunwatchConfig, RunProgress], Detector]:
    return lambda config, progress: spec.make(config.detectors, progress)


# Every detector the monitor drives, by name (the registry's order), and which view each reads. The
# model's health is one for the whole run, so it is judged on the joined step (one finding, not one
# per rank); the machine's (throughput, data, memory, liveness, a NaN on one rank) is each rank's
# own. In a single-rank run both views are its rank. Cross-rank detectors (straggler, hung rank)
# compare ranks: every rank's events, then each joined step's record, in runs of more than one rank.
DETECTORS: dict[str, Callable[[RunwatchConfig, RunProgress], Detector]] = {
    s.name: _builder(s) for s in registry.specs()
}
JOINED_VIEW = frozenset(registry.names("joined"))
CROSS_RANK_VIEW = frozenset(registry.names("cross_rank"))
RANK_VIEW = frozenset(DETECTORS) - JOINED_VIEW - CROSS_RANK_VIEW


def build_detectors(config: RunwatchConfig, names: frozenset[str], progress: RunProgress) -> list[Detector]:
    return [
        make(config, progress)
        for name, make in DETECTORS.items()
        if name in names and getattr(config.detectors, name).enabled
    ]


class RunMonitor:
    """All detector and policy state of one run. ``observe`` each event in order; ``tick`` on a timer."""

    # From its run_start: whether one came, and the attempt it named (class defaults: a monitor pickled
    # before they existed reads them as unknown).
    started: bool = False
    attempt: str | None = None
    # A rollback is settled once every rank has acknowledged it. Until then a rank that has not is still
    # sending steps from before it (ranks publish independently, so one rank's acknowledgement can arrive
    # before another's last faulty steps): those steps, and the joined steps up to the first acknowledging
    # rank's newest, are kept out of the rewound detectors.
    _settling: str | None = None  # the applied rollback not every rank has acknowledged yet
    _before_rollback: set[int] | frozenset[int] = frozenset()  # ranks yet to acknowledge it
    _stale_through: tuple[int, int] | None = None  # joined steps up to this (generation, step) came before it
    # (detector, metric, rank, severity, onset) of the findings issued that the policy does not act on:
    # the replay after a rollback finds the same onset again (the same slow steps, the same drift), and
    # says nothing new. None until the first (a class default: a monitor pickled before it reads None).
    _issued_onsets: OrderedDict[tuple[str, str, int | None, str, int | None], None] | None = None
    # Actions waiting for a rank's acknowledgement (ack_watch.py); None in a monitor pickled before it.
    acks: AckWatch | None = None
    # Ranks whose clock the worker found ahead of its own: rank -> seconds (None: none yet, or a monitor
    # pickled before it). Signed into the run's actions, so that such a rank's listener judges them on the
    # worker's clock; each rank is told once (a clock_skew finding).
    clock_ahead: dict[int, float] | None = None
    _clock_told: set[int] | None = None
    # This attempt's crashes (issue 39: engine/crashes.py), and what the run's earlier attempts' left (the
    # worker hands it on to a new attempt's monitor: ``take_crash_history``). None: no crash yet.
    crashes: CrashWatch | None = None
    crash_history: CrashHistory | None = None

    def __init__(self, run_id: str, config: RunwatchConfig):
        self.run_id = run_id
        self.config = config
        # Every rank's progress and liveness, read by the stall and hung-rank detectors.
        self.progress = RunProgress(config.detectors.stall)
        self.ranks: dict[int, list[Detector]] = {}
        self.joined_detectors = build_detectors(config, JOINED_VIEW, self.progress)
        self.cross_rank_detectors = cast(
            list[CrossRankDetector], build_detectors(config, CROSS_RANK_VIEW, self.progress)
        )
        self.join = StepJoin(run_id, config.join.timeout_s)
        self.policy = ActionPolicy(config.policy)
        self.acks = AckWatch(config.policy.ack_timeout_s)
        self.checkpoints = CheckpointLedger(config.policy.confirm_steps)
        # joined step -> the run's loss, the newest LOSS_HISTORY steps
        self.losses: OrderedDict[int, float] = OrderedDict()
        self.recovery: RecoveryCheck | None = None  # the latest rollback's, until it is judged
        # The step-indexed detectors' state at each checkpoint a rollback may target (rewind.py).
        self.snapshots: DetectorSnapshots[_RewindState] = DetectorSnapshots()
        self._rewound_for: str | None = (
            None  # the rollback whose ack rewound the detectors (one per rollback)
        )
        self.events_seen = 0
        self.last_step: int | None = None
        self._recent_ids: OrderedDict[str, None] = OrderedDict()  # the oldest is dropped first
        # From run_start: job_id, host, pod (a tag) for actions' params, so a remediator's
        # `scancel {job_id}` needs no lookup.
        self.job: dict[str, str] = {}
        # When rank 0's run_end came: from then on only the join goes on (other ranks' last steps may
        # still be on their way), until the worker lets the run go a join timeout later.
        self.ended_at: datetime | None = None
        # The run's summary as it goes, judged against its job's history when it ends (the worker
        # hands the history over with ``set_history``).
        self.baseline = RunEndBaselineCheck(run_id, config.baseline)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A monitor pickled when its bounded memories were plain dicts gets them as ordered dicts (in the
        same order: a plain dict keeps its insertion order too)."""
        self.__dict__.update(state)
        if not isinstance(self.losses, OrderedDict):  # (one from now has them so already: no copies)
            self._recent_ids = OrderedDict(self._recent_ids)
            self.losses = OrderedDict(self.losses)
            if self._issued_onsets is not None:
                self._issued_onsets = OrderedDict(self._issued_onsets)

    def ledger(self) -> RunLedger | None:
        """What this run keeps if it is let go (None: nothing a rollback or the policy would miss: no
        checkpoint, no rollback spent, not stopped)."""
        checkpoints, policy = self.checkpoints, self.policy
        if not (checkpoints.good or checkpoints.pending or policy.rollbacks or policy.stopped):
            return None
        return RunLedger(
            attempt=self.attempt,
            started=self.started,
            job=dict(self.job),
            world_size=self.join.world_size,
            good=list(checkpoints.good),
            pending=list(checkpoints.pending),
            rollbacks=policy.rollbacks,
            stopped=policy.stopped,
        )

    def take_ledger(self, ledger: RunLedger) -> None:
        """A fresh monitor of a run that was let go takes on what it kept (before its first event)."""
        self.attempt, self.started = ledger.attempt, ledger.started
        self.job = dict(ledger.job)
        self.join.set_world_size(ledger.world_size)
        self.checkpoints.good = list(ledger.good)
        self.checkpoints.pending = list(ledger.pending)
        self.policy.rollbacks, self.policy.stopped = ledger.rollbacks, ledger.stopped

    def _seen_before(self, event_id: str) -> bool:
        recent = self._recent_ids
        if event_id in recent:
            return True
        recent[event_id] = None
        if len(recent) > RECENT_EVENT_IDS:
            recent.popitem(last=False)
        return False

    def observe(self, event: TelemetryEvent) -> MonitorOutput:
        out = MonitorOutput()
        if self._seen_before(event.event_id):  # redelivered (a producer retry, a worker restart)
            self.join.count_duplicate()
            return out
        self.events_seen += 1
        self.baseline.observe(event)
        if self.ended_at is not None and event.kind not in ("step", "run_end", "crash"):
            return out  # the run is over: nothing but its last steps' join (and its last words) is judged
        route = _ROUTES.get(event.kind)
        if route is None:
            return out  # a kind this worker has no use for (a newer producer's): judged by none
        getattr(self, route)(event, out)  # (by name: a subclass's handler, group_monitor.py)
        self._await_acks(out, event.ts)
        return out

    def clock_seen(self, rank: int, ahead_s: float | None, ts: datetime, step: int | None) -> MonitorOutput:
        """The worker read an event of ``rank`` whose clock is ``ahead_s`` seconds ahead of its own (None:
        not ahead, beyond the wire's allowance): remember it for the run's actions, and say it once per rank
        with a ``clock_skew`` warning (the default policy alerts the trainer, whose listener can take the
        alert because the action carries the offset)."""
        out = MonitorOutput()
        ahead = self.clock_ahead if self.clock_ahead is not None else {}
        if ahead_s is None:
            ahead.pop(rank, None)  # (its clock was put right)
            return out
        self.clock_ahead = ahead
        if rank not in ahead and len(ahead) >= MAX_CLOCK_RANKS:
            return out  # (the actions carry a bounded list; the finding below already went out for many)
        ahead[rank] = round(ahead_s, 1)
        told = self._clock_told if self._clock_told is not None else set()
        self._clock_told = told
        if rank in told:
            return out
        told.add(rank)
        finding = Finding(
            detector=CLOCK_SKEW,
            metric="clock",
            step=step,
            rank=rank,
            severity="warning",
            value=round(ahead_s, 1),
            threshold=self.config.limits.max_future_s,
            message=(
                f"rank {rank}'s clock is {ahead_s:.0f} s ahead of the worker's (more than the "
                f"{self.config.limits.max_future_s:.0f} s a record may be ahead): its event times are moved "
                "back by that much and its actions say so; put the host's clock right (NTP)"
            ),
            evidence={"ahead_s": round(ahead_s, 1)},
        )
        self._emit(finding, ts, f"clock|{rank}", out)
        self._await_acks(out, ts)
        return out

    def _await_acks(self, out: MonitorOutput, at: datetime) -> None:
        """Every action issued now waits for a rank's acknowledgement (``tick`` judges the overdue)."""
        if out.decisions:
            if self.acks is None:
                self.acks = AckWatch(self.config.policy.ack_timeout_s)
            for decision in out.decisions:
                self.acks.issued(decision, at)

    # -- one handler per event kind (``_ROUTES``) ------------------------------------------------

    def is_new_attempt(self, event: RunStartEvent) -> bool:
        """Whether ``event`` starts another attempt of this run (a requeued or restarted job under the
        same run id), which is watched as a fresh run."""
        return event.attempt is not None and self.started and event.attempt != self.attempt

    def _on_run_start(self, event: RunStartEvent, out: MonitorOutput) -> None:
        self.started, self.attempt = True, event.attempt
        self.join.set_world_size(event.world_size)
        self.job = {
            name: value
            for name, value in (
                ("job_id", event.job_id),
                ("host", event.host),
                ("pod", event.tags.get("pod")),
            )
            if value
        }
        self._to_cross_rank(event, out)

    def _on_step(self, event: StepEvent, out: MonitorOutput) -> None:
        self.last_step = event.step
        self.policy.observe_progress(event.rank)  # a stall episode of this rank has cleared
        # (the guard spares the hot path a call per step while no rollback is settling)
        stale = self._settling is not None and self._sent_before_rollback(event)
        self._to_rank(event, out, stale=stale)
        for joined in self.join.add(event):
            self._observe_joined(joined, out)

    def _on_eval(self, event: EvalEvent, out: MonitorOutput) -> None:
        self._to_rank(event, out)
        for detector in self.joined_detectors:  # evals are the run's, not a rank's: the joined view's
            for finding in detector.update(event, event.ts):
                self._emit(self._run_level(finding), event.ts, event.event_id, out)

    def _on_heartbeat(self, event: HeartbeatEvent, out: MonitorOutput) -> None:
        self._to_rank(event, out)

    def _on_evidence(self, event: StackEvidenceEvent, out: MonitorOutput) -> None:
        """A rank's stacks: kept with its progress, for the hung-rank and stall findings (evidence.py)."""
        self.progress.observe(event)

    def _on_checkpoint(self, event: CheckpointEvent, out: MonitorOutput) -> None:
        if event.ok and not self._sent_before_rollback(event):  # (a checkpoint of the fault is no target)
            self.checkpoints.register(CheckpointRef(step=event.step, uri=event.uri, lr=event.lr))
            self.snapshots.take(event.step, self._rewindable())
        self._to_rank(event, out)

    def _on_action_ack(self, event: ActionAckEvent, out: MonitorOutput) -> None:
        if self.acks is not None:
            self.acks.acknowledged(event.action_id)
        if event.action_kind == "rollback":
            self._rollback_acknowledged(event)
        else:
            self.policy.acknowledge(event.action_id)
        self._to_cross_rank(event, out)

    def _on_run_end(self, event: RunEndEvent, out: MonitorOutput) -> None:
        """From now on only the join goes on. The rank detectors hear of it too: findings they held
        back waiting for a heartbeat's host load (throughput, data wait:
        detectors/runwatch/detectors/host_load.py) go out with what is known."""
        self.ended_at = event.ts
        for detectors in self.ranks.values():
            for detector in detectors:
                for finding in detector.update(event, event.ts):
                    self._emit(finding, event.ts, event.event_id, out)
        for finding in self.baseline.finish(event):
            self._emit(finding, event.ts, event.event_id, out)

    def set_history(self, candidates: list[RunSummary] | None, unavailable: str | None = None) -> None:
        """The earlier runs of this run's baseline key and fingerprint (their summaries), for the
        check when it ends; None where they could not be loaded (``unavailable`` says why)."""
        self.baseline.set_history(candidates, unavailable)

    # -- where an event goes ---------------------------------------------------------------------

    def _to_rank(
        self,
        event: StepEvent | EvalEvent | HeartbeatEvent | CheckpointEvent,
        out: MonitorOutput,
        stale: bool = False,
    ) -> None:
        """One rank's own event: its progress, the cross-rank detectors, then the rank's detectors (a
        ``stale`` step, sent before a rollback the detectors were rewound for, only the liveness ones)."""
        self.progress.observe(event)
        self._to_cross_rank(event, out)
        detectors = self.ranks.get(event.rank)
        if detectors is None:
            detectors = self.ranks[event.rank] = build_detectors(self.config, RANK_VIEW, self.progress)
        ts = event.ts
        for detector in detectors:
            if stale and detector.name not in EPISODIC_DETECTORS:
                continue
            for finding in detector.update(event, ts):
                self._emit(finding, ts, event.event_id, out)

    def _to_cross_rank(self, event: TelemetryEvent, out: MonitorOutput) -> None:
        if self.join.world_size > 1:  # compares ranks: nothing to do for one
            for detector in self.cross_rank_detectors:
                for finding in detector.update(event, event.ts):
                    self._emit(finding, event.ts, event.event_id, out)

    def finish(self) -> MonitorOutput:
        """The run is let go: its steps still waiting for a rank are joined as they are (and crashes still
        being gathered are settled)."""
        out = MonitorOutput()
        for joined in self.join.flush():
            self._observe_joined(joined, out)
        self._settle_crashes(None, out)
        return out

    def _observe_joined(self, joined: Joined, out: MonitorOutput) -> None:
        event = joined.event
        if joined.record is not None:
            out.joined.append(joined.record)
        if self._stale_through is not None and (joined.generation, event.step) <= self._stale_through:
            return  # completed after the rollback it came before: the rewound detectors must not judge it
        self._judge_joined(joined, out)
        if event.loss is not None:
            self._remember_loss(event.step, event.loss)
        self._verify_recovery(event, out)
        # Checkpoints after a rollback are confirmed only once the run has shown it recovered.
        if self.checkpoints.observe_step(event.step, hold=self.recovery is not None):
            self.snapshots.prune(
                [c.step for c in self.checkpoints.pending], [c.step for c in self.checkpoints.good]
            )

    def _judge_joined(self, joined: Joined, out: MonitorOutput) -> None:
        """The run-level detectors on the joined step, and (several ranks) the cross-rank ones on its
        record."""
        event = joined.event
        ts = event.ts
        for detector in self.joined_detectors:
            for finding in detector.update(event, ts):
                self._emit(self._run_level(finding), ts, event.event_id, out)
        if joined.record is not None and self.join.world_size > 1:
            for detector in self.cross_rank_detectors:
                for finding in detector.update(joined.record, event.ts):
                    self._emit(finding, event.ts, event.event_id, out)

    def _remember_loss(self, step: int, loss: float) -> None:
        """Keep the run's loss at ``step`` among the newest LOSS_HISTORY joined steps."""
        losses = self.losses
        losses.pop(step, None)  # a replayed step is the newest again
        losses[step] = loss
        if len(losses) > LOSS_HISTORY:
            losses.popitem(last=False)

    def _verify_recovery(self, event: StepEvent, out: MonitorOutput) -> None:
        """Feed the joined step to the check of the last rollback's replay, if one is under way; drop
        the check when it is done, or when the rollback expired unacknowledged."""
        if self.recovery is None:
            return  # (the usual step: no rollback being verified)
        if self.recovery.to_step is None and not self.policy.rollback_pending(event.ts):
            self.recovery = None  # the rollback expired unacknowledged: there is no replay to verify
        if self.recovery is not None:
            verdict = self.recovery.update(event.step, event.loss)
            if verdict is not None:
                anomaly = self._emit(verdict, event.ts, f"{event.event_id}|recovery", out)
                if anomaly is not None and verdict.detector == RECOVERED:
                    # the trainer hears that the rollback worked, as it heard of the rollback
                    decision = self.policy.recovered(anomaly)
                    if decision is not None:
                        out.decisions.append(decision)
            if self.recovery is not None and self.recovery.done:
                self.recovery = None

    def _rewindable(self) -> _RewindState:
        """The detectors whose state is about steps (not the liveness ones, which are about time)."""
        return {
            "joined": self.joined_detectors,
            "ranks": {
                rank: {i: d for i, d in enumerate(detectors) if d.name not in EPISODIC_DETECTORS}
                for rank, detectors in self.ranks.items()
            },
        }

    def _rewind(self, to_step: int) -> None:
        state = self.snapshots.restore(to_step)
        if state is None:
            # no snapshot (an old checkpoint, a restarted worker): the detectors judge the replay as they are
            return
        self.joined_detectors = state["joined"]
        for rank, saved in state["ranks"].items():
            for i, detector in saved.items():
                self.ranks[rank][i] = detector

    def _rollback_acknowledged(self, ack: ActionAckEvent) -> None:
        """A rank applied (or failed) a rollback: the replay starts, and so does its verification. The
        policy holds further rollbacks until every rank has acknowledged this one."""
        check = self.recovery
        if ack.outcome == "applied" and ack.to_step is not None:
            self.checkpoints.rolled_back(ack.to_step)
            if self._rewound_for != ack.action_id:  # every rank acks: rewind once, at the first
                self._rewound_for = ack.action_id
                self._rewind(ack.to_step)
                self._settling = ack.action_id
                self._before_rollback = self.join.expected()
                # Every step up to the acknowledging rank's newest came before the rollback; what follows is
                # the replay (a step counter that goes back starts a new generation, one that does not
                # goes on past it).
                self._stale_through = self.join.last_key(ack.rank)
            if check is not None and check.action_id == ack.action_id and check.to_step is None:
                check.arm(ack.to_step)
        elif check is not None and check.action_id == ack.action_id and check.to_step is None:
            self.recovery = None  # the rollback did not happen: nothing to verify
        if self._settling == ack.action_id:
            waiting = self._before_rollback
            if isinstance(waiting, frozenset):  # (a monitor pickled when it was one)
                waiting = self._before_rollback = set(waiting)
            waiting.discard(ack.rank)  # (in place: a copy per ack is the world squared at 16,384 ranks)
            if not waiting:
                self._settling = None
                self.policy.acknowledge(ack.action_id)
        else:
            self.policy.acknowledge(ack.action_id)  # not applied anywhere: nothing is in flight

    def _sent_before_rollback(self, event: StepEvent | CheckpointEvent) -> bool:
        """Whether ``event`` comes from a rank that has not acknowledged the rollback the detectors were
        rewound for (its steps were sent before the rollback took effect)."""
        if self._settling is None or event.rank not in self._before_rollback:
            return False
        if not self.policy.rollback_pending(event.ts):  # never acknowledged by every rank: expired
            self._settling, self._before_rollback = None, frozenset()
            return False
        return True

    def _run_level(self, finding: Finding) -> Finding:
        """A joined-view finding is about the run, not the rank whose figures the join started from, unless
        it names a rank it judged (a spike of one rank: ``evidence["rank"]``)."""
        if (
            self.join.world_size > 1
            and finding.rank is not None
            and finding.evidence.get("rank") != finding.rank
        ):
            return replace(finding, rank=None)
        return finding

    def tick(self, now: datetime) -> MonitorOutput:
        """Time-based checks at ``now`` (a timer online, event time offline): steps whose join timed
        out, stalled or silent ranks, a hung rank, and the escalation of what persists."""
        out = MonitorOutput()
        for joined in self.join.expire(now):
            self._observe_joined(joined, out)
        self._settle_crashes(now, out)
        if self.ended_at is not None:
            return out  # an ended run stalls, hangs and escalates no more
        self.progress.tick(now)
        ticking: list[Sequence[Detector]] = [self.cross_rank_detectors, *self.ranks.values()]
        for detectors in ticking:
            for detector in detectors:
                for finding in detector.tick(now):
                    # Keyed by what the finding is about (one per stall episode), not by the tick's
                    # time, so online and offline ticks give the same anomaly id.
                    self._emit(finding, now, f"tick|{finding.step}|{finding.evidence.get('kind')}", out)
        out.decisions.extend(self.policy.tick(now))  # a stall that persists past its alert escalates
        self._await_acks(out, now)
        # Last, and not awaited: the alert about an unanswered action would go unanswered too, and be
        # said again every ack_timeout_s.
        if self.acks is not None:
            for finding in self.acks.overdue(now):
                self._emit(finding, now, f"tick|ack|{finding.evidence['action_id']}", out)
        return out

    def _said_before(self, finding: Finding) -> bool:
        """Whether ``finding`` repeats one already issued for the same onset that the policy only reports
        (alert or nothing): then it is not issued again. One the policy acts on (a rollback, a stop) always
        is, and so does any finding of a detector some rule rolls back on: a fault that strikes again at
        the same step after a rollback must count towards the cap. Only for the detectors a rollback
        rewinds (about steps): a stall, a hang or a straggler again after a rollback happens again in
        time, and is said again."""
        if finding.detector in EPISODIC_DETECTORS or finding.detector in CROSS_RANK_VIEW:
            return False
        if finding.detector not in DETECTORS:
            return False  # the policy's own findings (not_recovered, recovered, baseline_outliers)
        kind = self.policy.action_for(finding.detector, finding.severity)
        if kind not in (None, "alert") or self.policy.rolls_back_on(finding.detector):
            return False
        onset = finding.onset_step if finding.onset_step is not None else finding.step
        key = (finding.detector, finding.metric, finding.rank, finding.severity, onset)
        issued = self._issued_onsets if self._issued_onsets is not None else OrderedDict()
        self._issued_onsets = issued
        if key in issued:
            return True
        issued[key] = None
        if len(issued) > ISSUED_ONSETS:
            issued.popitem(last=False)
        return False

    def _emit(self, finding: Finding, ts: datetime, cause: str, out: MonitorOutput) -> Anomaly | None:
        """Issue ``finding`` as an anomaly, and the action the policy decides for it; the anomaly (None: it
        repeats one already issued for the same onset)."""
        if self._said_before(finding):
            out.repeated.append(finding)
            return None
        anomaly = self._to_anomaly(finding, ts, cause)
        out.anomalies.append(anomaly)
        self.baseline.add_anomaly(anomaly)
        onset = anomaly.onset_step if anomaly.onset_step is not None else anomaly.step
        if anomaly.severity != "info" and self.policy.rolls_back_on(anomaly.detector):
            self.checkpoints.reject_for(onset)  # a checkpoint near a fault is never confirmed
        decision = self.policy.decide(anomaly, ts, self.checkpoints.target(onset))
        if decision is None:
            return anomaly
        out.decisions.append(decision)
        if decision.kind == "rollback" and self.config.policy.recovery.enabled and onset is not None:
            healthy = {
                s: loss for s, loss in self.losses.items() if s < onset and math.isfinite(loss) and loss > 0
            }
            self.recovery = RecoveryCheck(
                self.config.policy.recovery,
                decision.action_id,
                onset,
                healthy,
                anomaly.evidence.get("fault_onset_step"),
            )
        return anomaly

    def _to_anomaly(self, finding: Finding, ts: datetime, cause: str) -> Anomaly:
        # Deterministic id: the same event re-processed gives the same anomaly (idempotent sinks).
        key = f"{self.run_id}|{finding.detector}|{finding.metric}|{finding.rank}|{cause}"
        return Anomaly(
            anomaly_id=uuid.uuid5(_ANOMALY_NAMESPACE, key).hex,
            run_id=self.run_id,
            step=finding.step,
            onset_step=finding.onset_step,
            rank=finding.rank,
            detector=finding.detector,
            metric=finding.metric,
            value=finding.value,
            threshold=finding.threshold,
            score=finding.score,
            severity=finding.severity,
            message=finding.message,
            evidence=finding.evidence,
            ts=ts,
        )

    # -- crashes (issue 39) -----------------------------------------------------------------------------

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
        self, finding: Finding, ts: datetime, cause: str, out: MonitorOutput, decision: Any
    ) -> Anomaly | None:
        """A crash finding, and the crash policy's action (never the rules': a crash is not a detector's
        figure to alert on, its action is the class's)."""
        anomaly = self._to_anomaly(finding, ts, cause)
        out.anomalies.append(anomaly)
        self.baseline.add_anomaly(anomaly)
        if decision is not None and decision.kind is not None:
            out.decisions.append(
                ActionDecision(
                    action_id=decision_id(self.run_id, decision.kind, [anomaly.anomaly_id]),
                    run_id=self.run_id,
                    kind=decision.kind,
                    reason=decision.reason,
                    anomaly_ids=[anomaly.anomaly_id],
                    step=anomaly.step,
                    params=dict(decision.params),
                )
            )
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


# kind -> the monitor's handler of an event of that kind
_ROUTES: dict[str, str] = {
    "run_start": "_on_run_start",
    "step": "_on_step",
    "eval": "_on_eval",
    "heartbeat": "_on_heartbeat",
    "checkpoint": "_on_checkpoint",
    "action_ack": "_on_action_ack",
    "run_end": "_on_run_end",
    "evidence": "_on_evidence",
    "crash": "_on_crash",
}
