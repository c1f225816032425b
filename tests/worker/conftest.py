"""Fixtures of the worker tests without a broker (the integration fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.processor_events import SECRET, WALL


@pytest.fixture
def proc() -> TelemetryProcessor:
    # checkpoints confirmed after 6 healthy steps, so short test runs have a rollback target
    return TelemetryProcessor(
        RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}), SECRET, clock=lambda: WALL
    )
