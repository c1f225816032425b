"""From findings to actions: rules, cooldown, one rollback in flight, rollback cap, LR scale,
skipping the data window, escalation.

Pure: the caller passes ``now`` (event time online and offline alike).

Rollback. Each rollback's ``params`` carry ``lr_scale``, the cumulative factor relative to the
run's LR before any rollback (``lr_scale_on_rollback`` to the power of the rollback's number:
0.5, 0.25, ...), and with ``skip_data_window`` the inclusive step range ``skip_steps`` =
``[checkpoint step + 1, anomaly step]`` whose batches the trainer should not replay. The caller names the
target: the newest *confirmed-good* checkpoint before the update that caused the onset
(``checkpoints.CheckpointLedger``); with none, the rollback becomes ``no_good_checkpoint`` (a ``pause`` or a
``stop``, ``params.cause = "no_good_checkpoint"``): an unconfirmed checkpoint is never restored. After
``max_rollbacks`` rollbacks the next one is a ``stop`` (``params.cause = "max_rollbacks"``), and so is any
later warning of a detector that a rule rolls back on (the fault came back in a milder form: the run must not
go on degraded); after a stop nothing more is issued. ``alert_only`` turns every action into an alert.

Escalation ("alert, then stop if nothing changes"). A finding that the rules turn into an
``alert`` opens an *episode* for its detector when the alert is issued. Every later finding of
that detector that the rules also turn into an alert (issued, or held back by the cooldown)
continues the episode, unless it comes more than ``escalate_after_s`` after the previous one:
a detector quiet that long has cleared, and the finding opens a new episode. A rollback (issued
for any detector) clears every episode: the run changed. "Nothing changes" therefore means: the
same detector fires again at least ``escalate_after_s`` after the episode's first alert, never
quiet for longer than ``escalate_after_s`` in between, with no rollback in between. That finding
becomes a ``stop`` (``params.cause = "escalation"``) instead of an alert. A stall or a hung rank fires once
per episode, so one that simply persists is escalated by :meth:`ActionPolicy.tick` when the caller also
reports progress with :meth:`ActionPolicy.observe_progress` (a completed step of the stalled rank clears its
stall episode). ``escalate_after_s = 0`` turns escalation off.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from runwatch.contract.action_kinds import ActionKind, PolicyActionKind
from runwatch.contract.schema import SEVERITY_RANK, Anomaly, CheckpointRef, Severity
from runwatch.detectors import registry
from runwatch.detectors.config import PolicyConfig

_ID_NAMESPACE = uuid.UUID("6f1d0a52-4c5e-4b8e-9d0c-2b7a1e3f9a10")
# Evidence an alert carries on in its params, for the remediator's notification: a baseline check's
# outlier table; a hung or stalled rank's frame and its peers' (rank -> "file:line in function").
ALERT_EVIDENCE = ("baseline", "waits_in")
# Detectors that fire once per episode (a stall, a hung rank): what persists is escalated by tick().
EPISODIC_DETECTORS = tuple(s.name for s in registry.specs() if s.episodic)


@dataclass(frozen=True)
class ActionDecision:
    """An action to issue; the worker stamps, signs and publishes it."""

    action_id: str
    run_id: str
    kind: ActionKind
    reason: str
    anomaly_ids: list[str]
    step: int | None
    onset_step: int | None = None
    target_checkpoint: CheckpointRef | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlertEpisode:
    """One detector alerting, from its first alert until it clears (see the module doc)."""

    detector: str
    first_alert_at: datetime
    last_seen_at: datetime
    anomaly_id: str  # the latest finding's
    run_id: str
    step: int | None
    rank: int | None
    message: str


def _alert_params(anomaly: Anomaly) -> dict[str, Any]:
    """What a notification needs beyond the message (the outlier table of a run-end check)."""
    return {key: anomaly.evidence[key] for key in ALERT_EVIDENCE if key in anomaly.evidence}


def decision_id(run_id: str, kind: str, anomaly_ids: list[str]) -> str:
    # Deterministic, so re-processing the same events after a restart yields the same id
    # and every consumer's deduplication on action_id holds.
    return uuid.uuid5(_ID_NAMESPACE, f"{run_id}|{kind}|{','.join(sorted(anomaly_ids))}").hex


class ActionPolicy:
    def __init__(self, config: PolicyConfig):
        self.config = config
        self.rollbacks = 0
        self.stopped = False
        self._pending_rollback: tuple[str, datetime] | None = None  # action id, issued at (event time)
        self._last_issued: dict[tuple[str, str], datetime] = {}
        self.episodes: dict[str, AlertEpisode] = {}

    def _action_for(self, anomaly: Anomaly) -> PolicyActionKind | None:
        return self.action_for(anomaly.detector, anomaly.severity)

    def action_for(self, detector: str, severity: Severity) -> PolicyActionKind | None:
        """The kind of action the rules give a finding of ``detector`` at ``severity`` (None: none)."""
        rank = SEVERITY_RANK[severity]
        for rule in self.config.rules:
            if rule.detector in ("*", detector) and rank >= SEVERITY_RANK[rule.min_severity]:
                return "alert" if self.config.alert_only else rule.action
        return None

    def rolls_back_on(self, detector: str) -> bool:
        """Whether some rule turns a finding of ``detector`` (at some severity) into a rollback."""
        if self.config.alert_only:
            return False
        for rule in self.config.rules:
            if rule.detector in ("*", detector):
                if rule.action == "rollback":
                    return True
                if rule.min_severity == "info":
                    return False  # every severity is taken by an earlier, non-rollback rule
        return False

    @property
    def capped(self) -> bool:
        """Every allowed rollback has been spent: what comes next is a stop."""
        return self.rollbacks >= self.config.max_rollbacks

    def acknowledge(self, action_id: str) -> None:
        """The trainer reported the outcome of an action: a pending rollback is settled."""
        if self._pending_rollback and self._pending_rollback[0] == action_id:
            self._pending_rollback = None

    def rollback_pending(self, now: datetime) -> bool:
        if self._pending_rollback is None:
            return False
        if now - self._pending_rollback[1] > timedelta(seconds=self.config.action_ttl_s):
            self._pending_rollback = None  # never acknowledged: the action has expired
            return False
        return True

    # -- escalation ---------------------------------------------------------------------

    def _escalation_on(self) -> bool:
        return self.config.escalate_after_s > 0

    def _continue_episode(self, anomaly: Anomaly, now: datetime) -> AlertEpisode | None:
        """The open episode this alert-level finding continues (updated), or None if there is none."""
        episode = self.episodes.get(anomaly.detector)
        if episode is None:
            return None
        if (now - episode.last_seen_at).total_seconds() > self.config.escalate_after_s:
            del self.episodes[anomaly.detector]  # quiet long enough: the condition cleared
            return None
        episode.last_seen_at = max(episode.last_seen_at, now)
        episode.anomaly_id, episode.step, episode.rank = anomaly.anomaly_id, anomaly.step, anomaly.rank
        episode.message = anomaly.message
        return episode

    def _due(self, episode: AlertEpisode, now: datetime) -> bool:
        return (now - episode.first_alert_at).total_seconds() >= self.config.escalate_after_s

    def _escalate(self, episode: AlertEpisode, now: datetime) -> ActionDecision:
        since = (now - episode.first_alert_at).total_seconds()
        decision = ActionDecision(
            action_id=decision_id(episode.run_id, "stop", [episode.anomaly_id]),
            run_id=episode.run_id,
            kind="stop",
            reason=(
                f"escalated: {episode.detector} still firing {since:.0f} s after its first alert "
                f"(escalate_after_s {self.config.escalate_after_s:g}): {episode.message}"
            ),
            anomaly_ids=[episode.anomaly_id],
            step=episode.step,
            params={
                "cause": "escalation",
                "detector": episode.detector,
                "alerting_since": episode.first_alert_at.isoformat(),
                "alerting_s": since,
            },
        )
        self.stopped = True
        self.episodes.clear()
        return decision

    def observe_progress(self, rank: int | None) -> None:
        """A rank completed a step: its stall or hang episode (if any) has cleared."""
        if not self.episodes:
            return  # (the usual case, on every step event)
        for detector in EPISODIC_DETECTORS:
            episode = self.episodes.get(detector)
            if episode is not None and (episode.rank is None or episode.rank == rank):
                del self.episodes[detector]

    def tick(self, now: datetime) -> list[ActionDecision]:
        """Escalate a stall or a hang that persists (no progress since its alert) for ``escalate_after_s``."""
        if self.stopped or not self._escalation_on():
            return []
        for detector in EPISODIC_DETECTORS:
            episode = self.episodes.get(detector)
            if episode is not None and self._due(episode, now):
                return [self._escalate(episode, now)]
        return []

    # -- deciding -----------------------------------------------------------------------

    def _rollback_params(self, anomaly: Anomaly, checkpoint: CheckpointRef) -> dict[str, Any]:
        params: dict[str, Any] = {
            "lr_scale": self.config.lr_scale_on_rollback ** (self.rollbacks + 1),
            "lr_scale_per_rollback": self.config.lr_scale_on_rollback,
            "rollback_number": self.rollbacks + 1,
            "lr_restore_over_steps": self.config.lr_restore_over_steps,
        }
        if self.config.lr_restore_after_steps is not None:
            params["lr_restore_after_steps"] = self.config.lr_restore_after_steps
        if self.config.skip_data_window and anomaly.step is not None and checkpoint.step < anomaly.step:
            params["skip_steps"] = [checkpoint.step + 1, anomaly.step]
        return params

    def decide(
        self, anomaly: Anomaly, now: datetime, checkpoint: CheckpointRef | None = None
    ) -> ActionDecision | None:
        if self.stopped:
            return None
        kind = self._decided_kind(anomaly)
        if kind is None:
            return None
        onset = anomaly.evidence.get("onset_step", anomaly.step)
        reason = anomaly.message
        params: dict[str, Any] = {}
        episode: AlertEpisode | None = None
        if kind == "rollback":
            plan = self._plan_rollback(anomaly, now, checkpoint, onset)
            if plan is None:
                return None
            kind, reason, params = plan
        else:
            if kind == "alert" and self._escalation_on():
                episode = self._continue_episode(anomaly, now)
                if episode is not None and self._due(episode, now):
                    return self._escalate(episode, now)
            if self._in_cooldown(kind, anomaly.detector, now):
                return None
            if kind == "alert":
                params = _alert_params(anomaly)
        decision = ActionDecision(
            action_id=decision_id(anomaly.run_id, kind, [anomaly.anomaly_id]),
            run_id=anomaly.run_id,
            kind=kind,
            reason=reason,
            anomaly_ids=[anomaly.anomaly_id],
            step=anomaly.step,
            onset_step=onset,
            target_checkpoint=checkpoint if kind == "rollback" else None,
            params=params,
        )
        self._issued(decision, anomaly, now, episode)
        return decision

    def recovered(self, anomaly: Anomaly) -> ActionDecision | None:
        """The ``recovered`` action for a rollback the recovery check verified (``anomaly``, its ``recovered``
        finding), so the trainer's log says the rollback worked; none once the run is stopped."""
        if self.stopped:
            return None
        evidence = anomaly.evidence
        return ActionDecision(
            action_id=decision_id(anomaly.run_id, "recovered", [anomaly.anomaly_id]),
            run_id=anomaly.run_id,
            kind="recovered",
            reason=anomaly.message,
            anomaly_ids=[anomaly.anomaly_id],
            step=anomaly.step,
            onset_step=evidence.get("fault_onset_step"),
            params={key: evidence[key] for key in ("rolled_back_to", "ratio", "tolerance") if key in evidence}
            | {"rollback_action_id": evidence.get("action_id")},
        )

    def _decided_kind(self, anomaly: Anomaly) -> PolicyActionKind | None:
        """The kind of action the rules give ``anomaly``, None for none; after the rollback cap a milder
        return of the fault (an alert-level spike of a detector a rule rolls back on) is a rollback too,
        which the cap turns into a stop."""
        kind = self._action_for(anomaly)
        if (
            kind is not None
            and kind != "rollback"
            and self.capped
            and self.rollbacks > 0
            and self.rolls_back_on(anomaly.detector)
        ):
            return "rollback"
        return kind

    def _plan_rollback(
        self, anomaly: Anomaly, now: datetime, checkpoint: CheckpointRef | None, onset: int | None
    ) -> tuple[PolicyActionKind, str, dict[str, Any]] | None:
        """``(kind, reason, params)`` of the action a rollback becomes: a rollback to ``checkpoint``, or a
        stop at the cap, or ``no_good_checkpoint`` without a confirmed-good checkpoint; None while an
        earlier rollback is in flight, or for a pause still in its cooldown."""
        if self.rollback_pending(now):
            return None  # events still in flight from before the rollback took effect
        if self.capped:
            reason = f"rollback cap reached ({self.config.max_rollbacks} rollbacks): {anomaly.message}"
            return "stop", reason, {"cause": "max_rollbacks", "rollbacks": self.rollbacks}
        if checkpoint is None:
            # Never restore an unconfirmed checkpoint: it may hold the fault.
            kind = self.config.no_good_checkpoint
            if kind == "pause" and self._in_cooldown(kind, anomaly.detector, now):
                return None
            reason = f"no confirmed-good checkpoint before step {onset} to roll back to: {anomaly.message}"
            return kind, reason, {"cause": "no_good_checkpoint"}
        return "rollback", anomaly.message, self._rollback_params(anomaly, checkpoint)

    def _in_cooldown(self, kind: str, detector: str, now: datetime) -> bool:
        """Whether an action of ``kind`` was issued for ``detector`` less than ``cooldown_s`` ago."""
        last = self._last_issued.get((kind, detector))
        return last is not None and now - last < timedelta(seconds=self.config.cooldown_s)

    def _issued(
        self, decision: ActionDecision, anomaly: Anomaly, now: datetime, episode: AlertEpisode | None
    ) -> None:
        """Book an issued decision: its cooldown, and a rollback in flight (which clears every episode),
        a stop, or an alert's new episode (``episode``: the one it continued, if any)."""
        kind = decision.kind
        self._last_issued[(kind, anomaly.detector)] = now
        if kind == "rollback":
            self.rollbacks += 1
            self._pending_rollback = (decision.action_id, now)
            self.episodes.clear()  # the run changed: every alerting condition starts over
        elif kind == "stop":
            self.stopped = True
        elif kind == "alert" and episode is None and self._escalation_on():
            self.episodes[anomaly.detector] = AlertEpisode(
                detector=anomaly.detector,
                first_alert_at=now,
                last_seen_at=now,
                anomaly_id=anomaly.anomaly_id,
                run_id=anomaly.run_id,
                step=anomaly.step,
                rank=anomaly.rank,
                message=anomaly.message,
            )
