"""The action the remediation tests act on (tests/sinks/test_remediate_*.py, test_remediator.py): a stop
for run-1 at step 42, issued at ``NOW`` and expiring two minutes later, with a rollback target and a
reason that needs escaping in a chat message; any field can be overridden."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import Action, CheckpointRef
from runwatch.contract.signing import sign_action
from tests.support.action_keys import WORKERS

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def make_action(**overrides) -> Action:
    fields = dict(
        action_id="act-1",
        run_id="run-1",
        kind="stop",
        reason="loss <NaN> & grads",
        step=42,
        target_checkpoint=CheckpointRef(step=40, uri="/ckpt/40.pt"),
        issued_at=NOW,
        expires_at=NOW + timedelta(seconds=120),
    )
    fields.update(overrides)
    return Action(**fields)


def make_signed(**overrides) -> bytes:
    """The action's wire JSON, signed with the workers' key (tests.support.action_keys.WORKERS)."""
    return sign_action(make_action(**overrides), WORKERS).to_json()
