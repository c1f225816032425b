"""The action inbox: what a raw message from ``runwatch.actions`` must pass before anyone acts on it.

The trainer's ``ActionListener`` and the remediator (``runwatch remediate``) both take their
actions through an ``ActionInbox``, so both refuse the same things for the same reasons, in this
order, each counted in ``ignored``:

- ``malformed``: not a valid action (or anything else that makes judging it fail);
- ``other_run``: addressed to another run (only with ``run_id``: the trainer's inbox);
- ``bad_signature``: not signed over its canonical body by the workers' key (one of the public keys
  given: ``$RUNWATCH_ACTION_PUBLIC_KEYS``; nothing that holds only those can sign);
- ``other_attempt``: issued for another attempt of the run (only with ``attempt``: a trainer's inbox,
  when both the trainer and the action name one);
- ``future``: issued later than now plus the clock-skew allowance (``clock_skew``, by default
  ``DEFAULT_CLOCK_SKEW``: the listener and the remediator refuse the same actions);
- ``expired``: past its ``expires_at``;
- ``stale``: issued before ``not_before`` (the listener's start minus the allowance);
- ``duplicate``: admitted once already by this inbox (with ``remember``);
- then whatever ``handled(action)`` says: the owner's durable record of what it did (the trainer's
  applied ids: ``already_applied``; the remediator's recorded executions: ``duplicate``).

Pure: no Kafka, no torch, no publisher; the clock is injected.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from runwatch.contract.schema import Action, SchemaError, decode_action, utc_now
from runwatch.contract.signing import ActionPublicKeys

log = logging.getLogger(__name__)

# How far an action's issued_at may lie ahead of the reader's clock (and, for a trainer, before its
# start): the worker's and the reader's clocks may differ by this much.
DEFAULT_CLOCK_SKEW = timedelta(seconds=30)


@dataclass(frozen=True)
class Verdict:
    """An inbox's judgement of one message: the action (None where it did not decode) and why it is
    ignored (None: admitted); ``detail`` says what was malformed."""

    action: Action | None
    reason: str | None
    detail: str = ""


class ActionInbox:
    """Decodes, verifies and deduplicates raw action messages; see the module docstring.

    ``ignored`` counts the refusals by reason; the owner may count its own reasons in it too."""

    def __init__(
        self,
        public_keys: ActionPublicKeys,
        *,
        run_id: str | None = None,
        attempt: str | None = None,
        clock_skew: timedelta = DEFAULT_CLOCK_SKEW,
        not_before: datetime | None = None,
        remember: bool = True,
        handled: Callable[[Action], str | None] = lambda _action: None,
        now: Callable[[], datetime] = utc_now,
        rank: int | None = None,
    ):
        self._public_keys = public_keys
        # A trainer's rank: the clock offset the worker measured for it and signed applies
        # (Action.issuer_now); None (the sink, the remediator: the servers' clocks): none applies
        self._rank = rank
        self._run_id = run_id
        self._attempt = attempt
        self._clock_skew = clock_skew
        self._not_before = not_before
        self._remember = remember
        self._handled = handled
        self._now = now
        self._seen: set[str] = set()
        self.ignored: Counter[str] = Counter()

    def judge(self, raw: bytes | None) -> Verdict:
        """The verdict on ``raw``, counted; never raises, whatever the message holds."""
        try:
            verdict = self._judge(raw)
        except Exception as exc:  # noqa: BLE001 - never raises, whatever the message holds
            log.debug("runwatch: cannot judge an action: %r", exc)
            verdict = Verdict(None, "malformed", repr(exc))
        if verdict.reason is not None:
            self.ignored[verdict.reason] += 1
        return verdict

    def admit(self, raw: bytes | None) -> Action | None:
        """The action in ``raw`` if it passes, else None (counted in ``ignored``)."""
        verdict = self.judge(raw)
        return verdict.action if verdict.reason is None else None

    def verifies(self, action: Action) -> bool:
        """Whether ``action`` is for this inbox's run (if it has one) and signed by the workers' key."""
        return (self._run_id is None or action.run_id == self._run_id) and self._public_keys.verify(action)

    def mark_seen(self, action_id: str) -> None:
        """Take a later copy of ``action_id`` for a duplicate."""
        self._seen.add(action_id)

    def _judge(self, raw: bytes | None) -> Verdict:
        if raw is None:  # a record without a value (a tombstone)
            return Verdict(None, "malformed", "no value")
        try:
            action = decode_action(raw)
        except SchemaError as exc:
            return Verdict(None, "malformed", exc.reason)
        if self._run_id is not None and action.run_id != self._run_id:
            return Verdict(action, "other_run")  # another run's action on a shared partition
        if not self._public_keys.verify(action):
            return Verdict(action, "bad_signature")
        # (times judged on the issuing worker's clock: a rank whose clock it found fast is told by how much)
        local_now = self._now()
        now = local_now if self._rank is None else action.issuer_now(local_now, self._rank)
        not_before = None if self._not_before is None else self._not_before - (local_now - now)
        if self._attempt is not None and action.attempt is not None and action.attempt != self._attempt:
            return Verdict(action, "other_attempt")  # e.g. the stop that ended the job before it was requeued
        if action.issued_at > now + self._clock_skew:
            # signed, but not issued yet by our clock: never take it on trust
            return Verdict(action, "future")
        if action.is_expired(now):
            return Verdict(action, "expired")
        if not_before is not None and action.issued_at < not_before:
            return Verdict(action, "stale")
        if self._remember and action.action_id in self._seen:
            return Verdict(action, "duplicate")
        reason = self._handled(action)
        if reason is not None:
            return Verdict(action, reason)
        if self._remember:
            self._seen.add(action.action_id)
        return Verdict(action, None)
