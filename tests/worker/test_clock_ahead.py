"""Issue 35, item 9: a trainer whose clock is more than ``max_future_s`` (300 s) fast. The worker judges its
events against their record time, moves them back onto its own clock and says so once per rank (a
``clock_skew`` finding, alerted); its actions carry the rank's offset, signed, so that the rank's listener
judges them on the worker's clock. Before: every event dead-lettered, no finding, and every action the
trainer saw expired."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from runwatch.contract.inbox import ActionInbox
from runwatch.contract.schema import (
    CLOCK_AHEAD_PARAM,
    CheckpointEvent,
    StepEvent,
    decode_received,
)
from runwatch.contract.signing import ActionSigningKey
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import PUBLIC, SEED

WALL = datetime(2026, 11, 29, 8, 0, 0, tzinfo=UTC)  # the worker's clock
AHEAD_S = 420.0  # the trainer's clock: 7 minutes fast


class Clock:
    def __init__(self) -> None:
        self.now = WALL

    def __call__(self) -> datetime:
        return self.now


def processor(clock: Clock | None = None) -> TelemetryProcessor:
    return TelemetryProcessor(
        RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}}), SEED, clock=clock or Clock()
    )


def fast_trainer_record(event) -> tuple[bytes, float]:
    """What a trainer whose clock is AHEAD_S fast sends: its ts and its record time both on that clock."""
    return event.to_json(), event.ts.timestamp()


def run_of_a_fast_clock(proc: TelemetryProcessor, rank: int = 0, run_id: str = "fast-run"):
    """Steps a second apart, ending at WALL on the worker's clock (a NaN streak from step 8)."""
    results = []
    for s in range(12):
        proc._clock.now = WALL - timedelta(seconds=11 - s)  # type: ignore[attr-defined]
        ts = proc._clock.now + timedelta(seconds=AHEAD_S)  # type: ignore[attr-defined]
        if s == 1:
            ckpt = CheckpointEvent(run_id=run_id, step=1, uri="/ckpt/1.pt", ts=ts)
            raw, sent = fast_trainer_record(ckpt)
            results.append(proc.process(raw, key=run_id.encode(), timestamp=sent))
        step = StepEvent(run_id=run_id, rank=rank, step=s, loss=math.nan if s >= 8 else 1.0, ts=ts)
        raw, sent = fast_trainer_record(step)
        results.append(proc.process(raw, key=run_id.encode(), timestamp=sent))
    return results


def test_a_fast_trainer_is_watched_told_once_and_its_actions_carry_its_offset():
    proc = processor()
    results = run_of_a_fast_clock(proc)
    assert [r.deadletter for r in results if r.deadletter] == []
    assert proc.counters.processed == 13
    anomalies = [a for r in results for a in r.anomalies]
    skew = [a for a in anomalies if a.detector == "clock_skew"]
    assert len(skew) == 1 and skew[0].rank == 0
    assert skew[0].evidence["ahead_s"] == AHEAD_S
    # its times were moved back onto the worker's clock
    assert all(a.ts <= WALL + timedelta(seconds=5) for a in anomalies)
    actions = [a for r in results for a in r.actions]
    assert [a.kind for a in actions] == ["alert", "alert", "rollback"]  # the clock, then the NaN streak
    for action in actions:
        offsets = action.params[CLOCK_AHEAD_PARAM]
        assert offsets == {"0": AHEAD_S}
    # the trainer's listener, on its own fast clock, takes the rollback (it would have found it expired)
    rollback = actions[-1]
    trainer_now = WALL + timedelta(seconds=AHEAD_S)
    assert rollback.is_expired(trainer_now)
    inbox = ActionInbox(PUBLIC, run_id="fast-run", rank=0, now=lambda: trainer_now)
    verdict = inbox.judge(rollback.to_json())
    assert verdict.reason is None, verdict


def test_a_rank_whose_clock_is_put_right_leaves_the_actions():
    proc = processor()
    run_of_a_fast_clock(proc)
    monitor = proc.monitors["fast-run"]
    assert monitor.clock_ahead == {0: monitor.clock_ahead[0]}
    on_time = StepEvent(run_id="fast-run", step=12, loss=1.0, ts=WALL).to_json()
    proc.process(on_time, key=b"fast-run", timestamp=WALL.timestamp())
    assert monitor.clock_ahead == {}


def test_the_offset_applies_only_to_the_rank_it_was_measured_for_and_only_when_signed():
    proc = processor()
    rollback = [a for r in run_of_a_fast_clock(proc, rank=0) for a in r.actions][-1]
    trainer_now = WALL + timedelta(seconds=AHEAD_S)
    keys = PUBLIC
    # rank 1 (on the same fast host clock) was not measured: the offset is not its own
    on_time = ActionInbox(keys, run_id="fast-run", rank=1, now=lambda: WALL + timedelta(seconds=AHEAD_S))
    assert on_time.judge(rollback.to_json()).reason == "expired"
    # a verifier of the servers (sink, remediator: no rank) judges on its own clock
    server = ActionInbox(keys, run_id="fast-run", now=lambda: trainer_now)
    assert server.judge(rollback.to_json()).reason == "expired"
    # an offset added or changed by anyone but the workers breaks the signature
    forged = rollback.model_copy(update={"params": {**rollback.params, CLOCK_AHEAD_PARAM: {"0": 86_000}}})
    inbox = ActionInbox(keys, run_id="fast-run", rank=0, now=lambda: trainer_now)
    assert inbox.judge(forged.to_json()).reason == "bad_signature"
    # and one signed by another key is refused however it reads
    resigned = ActionSigningKey.generate().sign(forged)
    assert inbox.judge(resigned.to_json()).reason == "bad_signature"


def test_a_record_time_more_than_a_day_ahead_is_no_clock_and_is_refused_as_before():
    far = WALL + timedelta(days=2)
    raw = StepEvent(run_id="r", step=1, loss=1.0, ts=far).to_json()
    letter = processor().process(raw, key=b"r", timestamp=far.timestamp()).deadletter
    assert letter is not None and letter.reason.startswith("limits: ts:")


def test_the_sink_and_the_worker_read_a_fast_record_alike():
    ts = WALL + timedelta(seconds=AHEAD_S)
    raw = StepEvent(run_id="r", step=1, loss=1.0, ts=ts).to_json()
    event, received, ahead = decode_received(raw, ts.timestamp(), WALL, key=b"r")
    assert ahead == AHEAD_S and received == WALL and event.ts == WALL
    event, received, ahead = decode_received(raw, None, ts)  # (no record time: judged on the reader's clock)
    assert ahead is None and event.ts == ts
