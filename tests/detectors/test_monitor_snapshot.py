"""A ``RunMonitor`` pickled before its bounded memories (the event ids seen, the joined steps' losses, the
onsets issued) were ordered dicts still loads, and carries on as one that was never pickled: the same
anomalies, the same redelivered events dropped, the same oldest entries let go. Seeded."""

from __future__ import annotations

import math
import pickle
import random
from collections import OrderedDict
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import Anomaly, StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine import monitor as monitor_module
from runwatch.detectors.engine.monitor import RunMonitor

T0 = datetime(2026, 11, 27, tzinfo=UTC)


def _steps(n: int = 400, seed: int = 7) -> list[StepEvent]:
    """A noisy loss, and the data loader's wait half of the step time for 50 steps in every 100 from step
    60 on: a data-wait episode each time (alert-level findings, so there are onsets to remember)."""
    rng = random.Random(seed)
    return [
        StepEvent(
            run_id="r",
            step=s,
            ts=T0 + timedelta(seconds=s),
            event_id=f"e{s}",
            loss=2.0 * math.exp(rng.gauss(0, 0.03)),
            step_time_s=0.2,
            data_wait_s=0.1 if s >= 60 and (s - 60) % 100 < 50 else 0.01,
        )
        for s in range(n)
    ]


def _observe(monitor: RunMonitor, events: list[StepEvent]) -> list[Anomaly]:
    return [a for e in events for a in monitor.observe(e).anomalies]


def _as_pickled_before(monitor: RunMonitor) -> bytes:
    """``monitor`` pickled as the code before pickled it: its bounded memories plain dicts (in the same
    order), and no ``__setstate__`` of its own to write it (the state is the ``__dict__``)."""
    state = dict(vars(monitor))
    state["_recent_ids"] = dict(monitor._recent_ids)
    state["losses"] = dict(monitor.losses)
    assert monitor._issued_onsets is not None  # (the stream's spikes were issued)
    state["_issued_onsets"] = dict(monitor._issued_onsets)
    del state["acks"]  # (the code before issue 35 waited for no acknowledgement)
    as_before = RunMonitor.__new__(RunMonitor)
    as_before.__dict__.update(state)
    return pickle.dumps(as_before)


@pytest.fixture(autouse=True)
def _small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds the stream outgrows, so the oldest entries are let go before and after the snapshot."""
    monkeypatch.setattr(monitor_module, "RECENT_EVENT_IDS", 50)
    monkeypatch.setattr(monitor_module, "LOSS_HISTORY", 30)
    monkeypatch.setattr(monitor_module, "ISSUED_ONSETS", 2)


def test_a_monitor_pickled_with_plain_dicts_loads_and_carries_on():
    events = _steps()
    straight = RunMonitor("r", RunwatchConfig())
    whole = _observe(straight, events)
    first = RunMonitor("r", RunwatchConfig())
    before = _observe(first, events[:250])
    assert len(first._issued_onsets or {}) == 2 and len(first.losses) == 30
    old = _as_pickled_before(first)
    assert b"OrderedDict" not in old  # (the old format indeed)
    restored = pickle.loads(old)
    assert isinstance(restored._recent_ids, OrderedDict) and isinstance(restored.losses, OrderedDict)
    assert isinstance(restored._issued_onsets, OrderedDict)
    assert list(restored.losses) == list(first.losses) and list(restored._recent_ids) == list(
        first._recent_ids
    )
    assert restored.observe(events[249]).anomalies == []  # redelivered: dropped
    assert before and before + _observe(restored, events[250:]) == whole
    assert restored.join.duplicates == 1
    # the same newest entries kept, in the same order, as by the monitor that was never pickled
    assert (
        list(restored.losses.items())
        == list(straight.losses.items())
        == [(s, events[s].loss) for s in range(370, 400)]
    )
    assert list(restored._recent_ids) == list(straight._recent_ids) == [f"e{s}" for s in range(350, 400)]
    assert restored._issued_onsets == straight._issued_onsets


def test_a_monitor_from_before_any_onset_was_issued_keeps_none():
    monitor = RunMonitor("r", RunwatchConfig())
    _observe(monitor, _steps(20))
    assert monitor._issued_onsets is None
    restored = pickle.loads(pickle.dumps(monitor))
    assert restored._issued_onsets is None and list(restored.losses) == list(range(20))
