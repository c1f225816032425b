"""The action kinds, declared once: every part that issues, applies, shows or documents an action reads
this table (the policy, the trainer's listener, the report, the notifications, Grafana and the docs).

Adding a kind: its row here and its name in ``ActionKind`` (and ``PolicyActionKind`` if a policy rule
may name it; both checked against the table on import), a trainer-side handler in
``producer/runwatch/producer/actions/apply.py`` if it is applied in a new way (keyed by ``applies``), and its
row in docs/wire-format.md's table (checked by tests/contract/test_action_kinds.py, which also runs every kind
through issue, sign, apply, acknowledge and report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ActionKind = Literal["alert", "pause", "resume", "rollback", "stop", "recovered", "restart"]
PolicyActionKind = Literal["alert", "pause", "rollback", "stop"]  # the kinds a policy rule may name

# How the trainer's listener applies a kind (producer/runwatch/producer/actions/apply.py
# has one handler per value).
Applies = Literal["note", "pause", "resume", "rollback", "stop"]


@dataclass(frozen=True)
class ActionKindSpec:
    name: str  # the wire name (``Action.kind``)
    order: int  # how drastic, for sorting and escalation: alert < pause < rollback < stop
    policy_rule: bool  # whether a policy rule may name it (``policy.rules[].action``)
    applies: Applies  # how the trainer's listener applies it
    ends_pause: bool  # a pending pause ends when it arrives
    color: str  # the report's (a CSS colour)
    chat_color: str  # Slack-style attachment colour in notifications: good, warning or danger
    summary: str  # what it does, for the docs' table


ACTION_KINDS: dict[str, ActionKindSpec] = {
    spec.name: spec
    for spec in (
        ActionKindSpec(
            name="alert",
            order=1,
            policy_rule=True,
            applies="note",
            ends_pause=False,
            color="#ff7f0e",
            chat_color="warning",
            summary="tells people (the notification channels); the trainer only acknowledges it",
        ),
        ActionKindSpec(
            name="pause",
            order=2,
            policy_rule=True,
            applies="pause",
            ends_pause=False,
            color="#9467bd",
            chat_color="warning",
            summary="blocks the training loop until a `resume` or `stop` arrives or the pause times out",
        ),
        ActionKindSpec(
            name="resume",
            order=0,
            policy_rule=False,
            applies="resume",
            ends_pause=True,
            color="#2ca02c",
            chat_color="good",
            summary="ends a pause (sent by an operator or a remediator, never by the policy)",
        ),
        ActionKindSpec(
            name="rollback",
            order=3,
            policy_rule=True,
            applies="rollback",
            ends_pause=False,
            color="#d62728",
            chat_color="danger",
            summary=(
                "restores the last confirmed-good checkpoint, scales the LR and names the data window to skip"
            ),
        ),
        ActionKindSpec(
            name="stop",
            order=4,
            policy_rule=True,
            applies="stop",
            ends_pause=True,
            color="#000000",
            chat_color="danger",
            summary="ends the run gracefully at the next step (and ends a pause)",
        ),
        ActionKindSpec(
            name="recovered",
            order=0,
            policy_rule=False,
            applies="note",
            ends_pause=False,
            color="#17becf",
            chat_color="good",
            summary=(
                "says a rollback worked: the replayed run is back to its loss before the fault (sent by the "
                "worker's recovery check, never by a rule); the trainer only acknowledges it"
            ),
        ),
        # -- issue 39: a crashed run restarted by the remediator -------------------------------------------
        ActionKindSpec(
            name="restart",
            order=3,
            policy_rule=False,
            applies="note",
            ends_pause=False,
            color="#8c564b",
            chat_color="danger",
            summary=(
                "restarts a crashed run, as it was or without the failing host (`params.mode`, "
                "`params.exclude_hosts`, `params.crash_class`): sent by the worker's crash policy, never by "
                "a rule, and done by the remediator (`scontrol requeue`, `kubectl delete pod`); a trainer "
                "still running only acknowledges it"
            ),
        ),
    )
}

POLICY_KINDS: tuple[str, ...] = tuple(name for name, spec in ACTION_KINDS.items() if spec.policy_rule)
PAUSE_ENDERS: frozenset[str] = frozenset(name for name, spec in ACTION_KINDS.items() if spec.ends_pause)

# One declaration: the types (which pydantic and mypy read) must say what the table says.
if tuple(ACTION_KINDS) != get_args(ActionKind) or POLICY_KINDS != get_args(PolicyActionKind):
    raise RuntimeError(
        f"ActionKind {get_args(ActionKind)} / PolicyActionKind {get_args(PolicyActionKind)} "
        f"disagree with ACTION_KINDS {tuple(ACTION_KINDS)} (policy kinds {POLICY_KINDS})"
    )


def applies(kind: str) -> Applies:
    """How the trainer applies ``kind``."""
    return ACTION_KINDS[kind].applies
