"""What the processor tests share (tests/worker/test_processor*.py and the ``proc`` fixture in
tests/worker/conftest.py): the workers' key, the event and wall clocks, and a step event's bytes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import StepEvent
from tests.support.action_keys import SEED

SECRET = SEED  # the workers' signing key
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
# The worker's wall clock: events without a record time are checked against it (within 7 days before it)
WALL = T0 + timedelta(hours=6)


def step_json(step: int, loss: float = 1.0, run_id: str = "run-1") -> bytes:
    """A step event of ``run_id`` at ``step``, stamped ``step`` seconds after ``T0``."""
    return StepEvent(run_id=run_id, step=step, loss=loss, ts=T0 + timedelta(seconds=step)).to_json()
