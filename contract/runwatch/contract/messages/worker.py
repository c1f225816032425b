"""What the worker publishes: findings (``Anomaly``), joined steps, and signed actions."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import orjson
from pydantic import Field, model_validator

from runwatch.contract.action_kinds import ActionKind
from runwatch.contract.messages.base import SCHEMA_VERSION, Severity, WireFloat, WireModel


class Anomaly(WireModel):
    """A detector finding, as published on ``runwatch.anomalies``."""

    schema_version: int = SCHEMA_VERSION
    anomaly_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    step: int | None = None
    # Where the detector estimates the fault began (``step`` is where it was found); None: no estimate.
    onset_step: int | None = None
    rank: int | None = None
    detector: str
    metric: str
    value: float | None = None
    threshold: float | None = None
    score: float | None = None
    severity: Severity
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    ts: datetime  # the event time of what the finding is about (the step's, or the tick's)
    # When the worker produced it, by the worker's own wall clock (UTC); ``detected_at - ts`` is the
    # detection latency. None where no worker made it (offline replay): the detectors have no clock.
    detected_at: datetime | None = None


class JoinedStep(WireModel):
    """One step of a run across its ranks, as the worker's join combined it (``runwatch.joined``).

    ``reported_count`` and ``missing_count`` say how many ranks reported the step and how many did not;
    ``ranks_reported`` lists them only in a world of at most ``RANKS_LISTED`` ranks, ``ranks_missing``
    the lowest ``RANKS_LISTED`` of the missing. Gradient norms: the root of the sum of squares of the
    ranks' figures when they report shards (``grad_sharded``), else the largest (replicas agree). Loss:
    the mean over the ranks. Step time and memory: the extremes and the rank that has them.
    Throughput: the sum. ``complete`` is False when the join timed out without every rank.
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str = Field(min_length=1)
    step: int = Field(ge=0)
    generation: int = Field(
        default=0, ge=0, description="rollbacks seen before this step (steps repeat after one)"
    )
    ts: datetime
    world_size: int = Field(ge=1)
    complete: bool
    # The ranks by id only while they are few (issue 36: at 16,384 ranks the full lists were 87 KB a
    # step): every reporting rank when the world is at most RANKS_LISTED, else none; the missing ranks'
    # lowest RANKS_LISTED ids. The counts are always whole (absent in a record of an older worker: the
    # lists' lengths, which were whole then).
    ranks_reported: list[int] = Field(default_factory=list)
    ranks_missing: list[int] = Field(default_factory=list)
    reported_count: int = Field(default=-1, ge=-1)
    missing_count: int = Field(default=-1, ge=-1)
    loss_mean: float | None = None
    grad_norm: float | None = None
    grad_sharded: bool = False
    step_time_max_s: float | None = None
    step_time_max_rank: int | None = None
    step_time_min_s: float | None = None
    compute_max_s: float | None = None
    compute_max_rank: int | None = None
    compute_min_s: float | None = None
    memory_max_bytes: int | None = None
    memory_max_rank: int | None = None
    memory_min_bytes: int | None = None
    memory_min_rank: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    late_events: int = Field(
        default=0, ge=0, description="events of this run that came after their step was joined"
    )
    duplicate_events: int = Field(default=0, ge=0, description="events of this run delivered more than once")

    @model_validator(mode="after")
    def _whole_counts(self) -> JoinedStep:
        if self.reported_count < 0:
            self.reported_count = len(self.ranks_reported)
        if self.missing_count < 0:
            self.missing_count = len(self.ranks_missing)
        return self


class CheckpointRef(WireModel):
    step: int = Field(ge=0)
    uri: str
    lr: list[WireFloat] | None = None  # as in its CheckpointEvent


def newest_checkpoint_before(
    checkpoints: list[CheckpointRef], onset_step: int | None
) -> CheckpointRef | None:
    """The rollback target both sides agree on: the newest checkpoint strictly before the onset
    (a checkpoint taken at the faulty step may already hold its damage)."""
    earlier = [c for c in checkpoints if onset_step is None or c.step < onset_step]
    return max(earlier, key=lambda c: c.step) if earlier else None


class Action(WireModel):
    """A signed instruction to the trainer and remediators, on ``runwatch.actions``."""

    schema_version: int = SCHEMA_VERSION
    action_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    kind: ActionKind
    reason: str
    anomaly_ids: list[str] = Field(default_factory=list)
    step: int | None = None
    onset_step: int | None = None
    target_checkpoint: CheckpointRef | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    attempt: str | None = None  # the run's attempt it was issued for (its run_start's), when it sent one
    issued_at: datetime
    expires_at: datetime
    signature: str = ""

    def body_bytes(self) -> bytes:
        """Canonical bytes the signature covers: the message as sent (no null fields, NaN/Inf
        as strings) without ``signature``, keys sorted at every level, no whitespace."""
        sent = orjson.loads(self.model_dump_json(exclude={"signature"}, exclude_none=True))
        return orjson.dumps(sent, option=orjson.OPT_SORT_KEYS)

    def is_expired(self, now: datetime) -> bool:
        return now >= self.expires_at

    def issuer_now(self, now: datetime, rank: int) -> datetime:
        """``now``, a trainer rank's clock, on the clock of the worker that issued this action: less what the
        worker measured that rank's clock to be ahead of its own and signed with the action
        (``params.clock_ahead_s``: rank -> seconds; issue 35). A trainer whose clock is minutes fast would
        otherwise find every action expired, or issued before its listener started. Only a verified
        action's word counts: call it after the signature check."""
        ahead = self.params.get(CLOCK_AHEAD_PARAM)
        seconds = ahead.get(str(rank)) if isinstance(ahead, dict) else None
        if (
            isinstance(seconds, int | float)
            and not isinstance(seconds, bool)
            and 0 < seconds <= MAX_CLOCK_AHEAD_S
        ):
            return now - timedelta(seconds=seconds)
        return now


# An action's params entry: rank (as a string) -> seconds that rank's clock is ahead of the issuing worker's
CLOCK_AHEAD_PARAM = "clock_ahead_s"
MAX_CLOCK_AHEAD_S = 86_400.0  # a record time further ahead is no clock: its events are judged as before


RANKS_LISTED = 64  # rank ids a joined step lists at most (reported: only in a world this small)


def action_expiry(issued_at: datetime, ttl_s: float) -> datetime:
    return issued_at + timedelta(seconds=ttl_s)
