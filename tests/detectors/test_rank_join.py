"""The cross-rank join, the straggler and hung-rank detectors, and the monitor's two views."""

from __future__ import annotations

import math
import pickle
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import (
    CategoryLoss,
    HeartbeatEvent,
    JoinedStep,
    MemoryStats,
    RunStartEvent,
    StepEvent,
)
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.config import HungRankConfig, StallConfig, StragglerConfig
from runwatch.detectors.engine.rank_join import StepJoin
from runwatch.detectors.hung_rank import HungRankDetector
from runwatch.detectors.straggler import StragglerDetector

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "run-join"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def step(rank: int, n: int, t: float, **fields) -> StepEvent:
    fields.setdefault("loss", 1.0)
    return StepEvent(run_id=RUN, rank=rank, step=n, ts=at(t), **fields)


def beat(
    rank: int, n: int | None, t: float, phase: str = "train", in_sync: bool | None = None
) -> HeartbeatEvent:
    return HeartbeatEvent(run_id=RUN, rank=rank, step=n, ts=at(t), phase=phase, in_sync=in_sync)


def see(detector, event) -> list:
    return detector.update(event, event.ts)


def joined(n: int, t: float) -> JoinedStep:
    """Step ``n``'s joined record, as the monitor gives it to a cross-rank detector after the ranks' step
    events (the straggler reads its step)."""
    return JoinedStep(run_id=RUN, step=n, ts=at(t), world_size=2, complete=True, ranks_reported=[0, 1])


def test_sharded_norms_join_to_the_root_of_the_sum_of_squares():
    join = StepJoin(RUN)
    join.set_world_size(3)
    parts = [3.0, 4.0, 12.0]
    out = []
    for rank, g in enumerate(parts):
        out += join.add(
            step(
                rank,
                0,
                0.01 * rank,
                grad_norm=g,
                grad_sharded=True,
                loss=float(rank),
                module_grad_norms={"a": g, f"only{rank}": 1.0},
            )
        )
    assert len(out) == 1
    joined = out[0]
    assert joined.event.grad_norm == pytest.approx(13.0)
    assert joined.record.grad_norm == pytest.approx(13.0) and joined.record.grad_sharded
    assert joined.event.module_grad_norms["a"] == pytest.approx(13.0)
    assert joined.event.module_grad_norms["only2"] == pytest.approx(1.0)
    assert joined.event.loss == pytest.approx(1.0)  # the mean of 0, 1, 2
    assert joined.record.complete and joined.record.ranks_reported == [0, 1, 2]


def test_replicated_norms_are_not_summed_and_extremes_name_their_rank():
    join = StepJoin(RUN)
    join.set_world_size(3)
    out = []
    times = [0.10, 0.30, 0.20]
    memory = [100, 50, 300]
    for rank in range(3):
        out += join.add(
            step(
                rank,
                5,
                1.0,
                grad_norm=2.0,
                step_time_s=times[rank],
                samples_per_s=10.0,
                memory=MemoryStats(allocated=memory[rank]),
                category_loss={"x": CategoryLoss(mean=float(rank), count=rank + 1)},
            )
        )
    (joined,) = out
    r = joined.record
    assert joined.event.grad_norm == 2.0 and not r.grad_sharded
    assert (r.step_time_max_s, r.step_time_max_rank, r.step_time_min_s) == (0.30, 1, 0.10)
    assert (r.memory_max_bytes, r.memory_max_rank, r.memory_min_bytes, r.memory_min_rank) == (300, 2, 50, 1)
    assert r.samples_per_s == pytest.approx(30.0)
    # count-weighted: (0*1 + 1*2 + 2*3) / 6
    assert (
        joined.event.category_loss["x"].mean == pytest.approx(8 / 6)
        and joined.event.category_loss["x"].count == 6
    )


def test_a_nan_on_one_rank_reaches_the_joined_step():
    join = StepJoin(RUN)
    join.set_world_size(2)
    join.add(step(0, 0, 0.0, loss=1.0, grad_norm=1.0))
    (joined,) = join.add(step(1, 0, 0.0, loss=math.nan, grad_norm=math.inf))
    assert math.isnan(joined.event.loss) and math.isinf(joined.event.grad_norm)


def test_out_of_order_late_and_duplicate_events():
    join = StepJoin(RUN, timeout_s=10.0)
    join.set_world_size(2)
    # rank 1 runs ahead: its steps 0 and 1 arrive before rank 0's
    assert join.add(step(1, 0, 0.0)) == []
    assert join.add(step(1, 1, 0.1)) == []
    assert join.add(step(1, 1, 0.1)) == []  # delivered twice
    assert join.duplicates == 1
    got = join.add(step(0, 0, 0.2)) + join.add(step(0, 1, 0.3))
    assert [j.event.step for j in got] == [0, 1] and all(j.record.complete for j in got)
    # rank 0 reports steps 2 and 3; rank 1 skips 2 (a step it never sent): once step 3 is complete,
    # step 2 can never be, and is emitted first, as partial
    assert join.add(step(0, 2, 0.4)) == []
    assert join.add(step(0, 3, 0.5)) == []
    got = join.add(step(1, 3, 0.6))
    assert [(j.event.step, j.record.complete, j.record.ranks_missing) for j in got] == [
        (2, False, [1]),
        (3, True, []),
    ]
    # rank 1 is slow: step 4 is joined without it after the timeout, and its own step 4 comes too late
    assert join.add(step(0, 4, 1.0)) == []
    (partial,) = join.expire(at(11.0))
    assert partial.event.step == 4 and partial.record.ranks_missing == [1]
    assert join.add(step(1, 4, 11.5)) == []
    assert join.late == 1


def test_a_silent_rank_costs_one_timeout_then_is_not_waited_for():
    join = StepJoin(RUN, timeout_s=5.0)
    join.set_world_size(3)
    join.add(step(0, 0, 0.0))
    join.add(step(1, 0, 0.0))
    assert join.expire(at(4.9)) == []
    (partial,) = join.expire(at(5.0))
    assert partial.record.ranks_missing == [2] and not partial.record.complete
    join.add(step(0, 1, 6.0))
    (next_step,) = join.add(step(1, 1, 6.0))  # rank 2 is absent: not waited for
    assert next_step.record.ranks_missing == [2]
    join.add(step(2, 2, 7.0))  # it is back: waited for again
    join.add(step(0, 2, 7.0))
    (back,) = join.add(step(1, 2, 7.0))
    assert back.record.complete and back.record.ranks_reported == [0, 1, 2]


def test_a_rollback_starts_a_new_generation_so_replayed_steps_join_afresh():
    join = StepJoin(RUN)
    join.set_world_size(2)
    for n in range(5):
        join.add(step(0, n, n))
        join.add(step(1, n, n))
    assert join.joined == 5
    # both ranks roll back to step 2 and replay 3, 4
    got = []
    for n in (3, 4):
        got += join.add(step(0, n, 10 + n))
        got += join.add(step(1, n, 10 + n))
    assert [(j.record.generation, j.event.step) for j in got] == [(1, 3), (1, 4)]
    assert join.late == 0


def test_single_rank_runs_pass_their_event_through_unchanged():
    join = StepJoin(RUN)
    event = step(0, 0, 0.0, grad_norm=1.5)
    (joined,) = join.add(event)
    assert joined.event is event and joined.record is None


def test_join_state_pickles_midway():
    join = StepJoin(RUN)
    join.set_world_size(2)
    join.add(step(0, 0, 0.0, grad_norm=3.0, grad_sharded=True))
    restored = pickle.loads(pickle.dumps(join))
    (joined,) = restored.add(step(1, 0, 0.0, grad_norm=4.0, grad_sharded=True))
    assert joined.event.grad_norm == pytest.approx(5.0)


def test_straggler_is_named_by_its_compute_time_not_its_equal_step_time():
    detector = StragglerDetector(StragglerConfig(min_steps=5, patience=3))
    found = []
    for n in range(30):
        for rank in range(3):
            compute = 0.30 if rank == 2 else 0.10 + 0.001 * rank
            see(detector, step(rank, n, n, step_time_s=0.31, compute_s=compute))
        found += detector.update(joined(n, n), at(n))
    assert [(f.rank, f.detector) for f in found] == [(2, "straggler")]
    assert found[0].score == pytest.approx(0.1 / 0.3, rel=1e-3)
    assert found[0].evidence["fastest_rank"] == 0 and found[0].evidence["timed"] == "compute_s"


def test_straggler_stays_quiet_on_even_ranks_and_rearms_after_recovery():
    detector = StragglerDetector(StragglerConfig(min_steps=5, patience=3, window=10))
    found = []
    for n in range(100):
        slow = 20 <= n < 50 or n >= 75
        for rank in range(4):
            see(detector, step(rank, n, n, step_time_s=0.5 if (rank == 1 and slow) else 0.2 + 0.01 * rank))
        found += [(n, f.rank) for f in detector.update(joined(n, n), at(n))]
    assert [r for _, r in found] == [1, 1]  # two episodes, each reported once
    assert 20 < found[0][0] < 35 and 75 < found[1][0] < 90


def _twenty_lockstep_steps(detector) -> None:
    """Steps 0..19 of three ranks, every 0.5 s."""
    for n in range(20):
        for rank in range(3):
            see(detector, step(rank, n, n * 0.5))


def test_hung_rank_peers_waiting_in_sync():
    cfg = RunwatchConfig()
    detector = HungRankDetector(HungRankConfig(floor_s=1.0), cfg.detectors.stall)
    _twenty_lockstep_steps(detector)
    # step 19 done at 9.5 s; ranks 0 and 1 then wait in the gradient sync, rank 2 never arrives
    findings = []
    t = 9.5
    while t < 40:
        t += 1.0
        for rank in range(3):
            see(detector, beat(rank, 19, t, in_sync=rank != 2))
        findings += [(t, f) for f in detector.tick(at(t))]
    ((when, finding),) = findings
    allowed = 3 * 0.5 + 10.0
    assert finding.rank == 2 and finding.evidence["kind"] == "peers_waiting"
    assert allowed < when - 9.5 <= allowed + 1.0
    assert finding.threshold == pytest.approx(allowed)


def test_a_rank_that_waited_on_a_peer_s_long_checkpoint_is_not_hung_when_the_peer_comes_back():
    """Rank 0 checkpoints for 6 s after step 19 while ranks 1 and 2 wait for it in the sync. When rank 0
    is back and waits in the sync too, a stale heartbeat of rank 2 (not yet saying it waits: a loaded
    machine) must not make rank 2 the hung one: its peers have waited for it only since then."""
    cfg = RunwatchConfig()
    detector = HungRankDetector(HungRankConfig(floor_s=1.0), cfg.detectors.stall)
    _twenty_lockstep_steps(detector)
    findings = []
    t = 9.5
    while t < 16.0:  # the checkpoint: rank 0 in it, rank 1 waiting, rank 2's heartbeats late and stale
        t += 0.5
        see(detector, beat(0, 19, t, phase="checkpoint", in_sync=False))
        see(detector, beat(1, 19, t, in_sync=True))
        see(detector, beat(2, 19, t - 0.4, in_sync=False))
        findings += detector.tick(at(t))
    for _ in range(3):  # rank 0 is back and waits too; rank 2's next heartbeat is still the stale kind
        t += 0.5
        see(detector, beat(0, 19, t, in_sync=True))
        see(detector, beat(1, 19, t, in_sync=True))
        see(detector, beat(2, 19, t - 0.4, in_sync=False))
        findings += detector.tick(at(t))
    assert findings == []
    while t < 60:  # but if rank 2 really never arrives, it is found, counted from when its peers all waited
        t += 1.0
        for rank in range(3):
            see(detector, beat(rank, 19, t, in_sync=rank != 2))
        findings += [(t, f) for f in detector.tick(at(t))]
    ((when, finding),) = findings
    assert finding.rank == 2 and finding.evidence["kind"] == "peers_waiting"
    assert when - 16.0 > finding.threshold


def test_a_rank_a_moment_behind_after_a_pause_every_rank_sat_out_is_not_hung():
    """Lockstep ranks all wait 6 s on rank 0's checkpoint; then ranks 0 and 1 report the next step a
    moment before rank 2 (its report is late on a loaded machine): rank 2 is behind, and has made no
    progress for 6 s, but it has been behind for a moment only."""
    cfg = RunwatchConfig()
    allowance = {"train": 2.0, "dataload": 2.0, "eval": 900.0, "checkpoint": 900.0, "idle": 3600.0}
    detector = HungRankDetector(HungRankConfig(floor_s=1.0, phase_allowance_s=allowance), cfg.detectors.stall)
    _twenty_lockstep_steps(detector)
    findings = []
    t = 9.5
    while t < 16.0:
        t += 0.5
        see(detector, beat(0, 19, t, phase="checkpoint", in_sync=False))
        for rank in (1, 2):
            see(detector, beat(rank, 19, t, in_sync=True))
        findings += detector.tick(at(t))
    for rank in (0, 1):
        see(detector, step(rank, 20, 16.2))
    see(detector, beat(2, 19, 16.3, in_sync=True))
    findings += detector.tick(at(16.5))
    see(detector, step(2, 20, 16.6))
    findings += detector.tick(at(16.75))
    assert findings == []


def test_hung_rank_behind_while_others_advance_and_nothing_without_evidence():
    detector = HungRankDetector(HungRankConfig(), StallConfig(heartbeat_timeout_s=60.0))
    for n in range(10):
        for rank in range(2):
            see(detector, step(rank, n, n))
    # rank 1 stops at step 9 but keeps beating; rank 0 goes on (no lockstep)
    findings = []
    for t in range(10, 40):
        see(detector, step(0, t, t))
        see(detector, beat(1, 9, t + 0.5))
        findings += detector.tick(at(t + 0.5))
    assert [(f.rank, f.evidence["kind"]) for f in findings] == [(1, "behind")]
    # all ranks stuck together without in_sync evidence: not pinned on anyone
    other = HungRankDetector(HungRankConfig(), StallConfig(heartbeat_timeout_s=60.0))
    for n in range(10):
        for rank in range(2):
            see(other, step(rank, n, n))
    for t in range(10, 60):
        for rank in range(2):
            see(other, beat(rank, 9, t))
        assert other.tick(at(t)) == []


def test_a_checkpoint_phase_is_not_a_hang():
    detector = HungRankDetector(HungRankConfig(), StallConfig(heartbeat_timeout_s=60.0))
    for n in range(10):
        for rank in range(2):
            see(detector, step(rank, n, n))
    for t in range(10, 300):
        see(detector, beat(0, 9, t, phase="checkpoint"))
        see(detector, beat(1, 9, t, in_sync=True))
        assert detector.tick(at(t)) == []


def _monitor(world: int) -> RunMonitor:
    monitor = RunMonitor(RUN, RunwatchConfig())
    monitor.observe(RunStartEvent(run_id=RUN, world_size=world, ts=T0))
    return monitor


def test_monitor_reports_a_model_fault_once_for_the_run_not_once_per_rank():
    monitor = _monitor(3)
    anomalies, joined = [], []
    for n in range(60):
        for rank in range(3):
            g = 500.0 if n == 50 else 1.0 + 0.01 * ((n * 7 + rank) % 5)
            out = monitor.observe(step(rank, n, n, grad_norm=g, loss=1.0))
            anomalies += out.anomalies
            joined += out.joined
    spikes = [a for a in anomalies if a.detector == "grad_norm_spike"]
    assert len(spikes) == 1 and spikes[0].rank is None and spikes[0].step == 50
    assert [j.step for j in joined] == list(range(60))


def test_monitor_drops_a_redelivered_event():
    monitor = _monitor(1)
    event = step(0, 0, 0.0)
    monitor.observe(event)
    monitor.observe(event)
    assert monitor.events_seen == 2 and monitor.join.duplicates == 1  # run_start + the step once


def _three_ranks_after_20_steps() -> RunMonitor:
    monitor = _monitor(3)
    for n in range(20):
        for rank in range(3):
            monitor.observe(step(rank, n, n * 0.2))
    return monitor


def test_ranks_waiting_for_a_peers_long_checkpoint_are_not_stalled():
    monitor = _three_ranks_after_20_steps()
    findings = []
    # rank 0 saves a checkpoint for 5 minutes; ranks 1 and 2 wait for it in the gradient sync
    for t in range(4, 300, 2):
        monitor.observe(
            HeartbeatEvent(run_id=RUN, rank=0, step=19, ts=at(t), phase="checkpoint", time_in_phase_s=t - 3.8)
        )
        for rank in (1, 2):
            findings += monitor.observe(beat(rank, 19, t + 0.1, in_sync=True)).anomalies
        findings += monitor.tick(at(t + 0.5)).anomalies
    assert findings == []
    # the same wait with nobody in a checkpoint is a stall of every rank
    stalled = _three_ranks_after_20_steps()
    found = []
    for t in range(4, 60, 2):
        for rank in range(3):
            found += stalled.observe(beat(rank, 19, t + 0.1, in_sync=rank != 0)).anomalies
        found += stalled.tick(at(t + 0.5)).anomalies
    assert {(a.detector, a.rank) for a in found} >= {("stall", 1), ("stall", 2), ("hung_rank", 0)}


def test_ranks_that_waited_for_a_peers_checkpoint_get_their_allowance_from_its_end():
    """The peer's checkpoint ends (its heartbeat says train) and a tick comes before the waiting
    ranks' next step events: they waited for the peer, they did not stall; a real hang after it is
    still found, one train allowance (10 s) + 3 median steps after the checkpoint ended."""
    monitor = _three_ranks_after_20_steps()
    findings = []
    for t in range(4, 60, 2):  # a 56 s checkpoint on rank 0; ranks 1 and 2 wait in the sync
        monitor.observe(
            HeartbeatEvent(run_id=RUN, rank=0, step=19, ts=at(t), phase="checkpoint", time_in_phase_s=t - 3.8)
        )
        for rank in (1, 2):
            findings += monitor.observe(beat(rank, 19, t + 0.1, in_sync=True)).anomalies
        findings += monitor.tick(at(t + 0.5)).anomalies
    findings += monitor.observe(beat(0, 19, 60.0)).anomalies  # the checkpoint is over
    findings += monitor.tick(at(60.1)).anomalies  # ... before ranks 1 and 2 report their step
    assert [a for a in findings if a.detector == "stall"] == []
    # nobody steps after it: a stall, counted from the checkpoint's end
    late = []
    for t in range(61, 80):
        for rank in range(3):
            late += monitor.observe(beat(rank, 19, t, in_sync=rank != 0)).anomalies
        late += monitor.tick(at(t + 0.5)).anomalies
    stalls = [a for a in late if a.detector == "stall"]
    assert stalls and min(a.ts for a in stalls) >= at(60 + 10)


def test_straggler_one_step_back_over_the_threshold_does_not_start_a_new_episode():
    detector = StragglerDetector(StragglerConfig(min_steps=5, patience=4, window=5))
    found = []
    for n in range(60):
        blip = n in (30, 31, 32)  # the slow rank has three quick steps: its median dips for a moment
        for rank in range(2):
            slow = rank == 1 and not blip
            see(detector, step(rank, n, n, step_time_s=0.5 if slow else 0.2))
        found += [f.rank for f in detector.update(joined(n, n), at(n))]
    assert found == [1]


def test_a_joined_step_of_16384_ranks_counts_its_ranks_and_lists_few_of_them():
    """Issue 36: the joined record listed every rank (87 KB a step at 16,384 ranks); it counts them and
    lists the lowest 64 missing ids only, and stays under 8 KB."""
    world = 16_384
    join = StepJoin(RUN, 5.0)
    join.set_world_size(world)
    missing = {7, 9_001, 12_345}
    out = []
    for rank in range(world):
        if rank not in missing:
            out += join.add(step(rank, 3, 1.0))
    assert out == []  # (waiting for the three)
    (late,) = join.expire(at(10.0))
    record = late.record
    assert (record.reported_count, record.missing_count) == (world - 3, 3)
    assert record.ranks_missing == sorted(missing) and record.ranks_reported == []
    assert not record.complete and len(record.to_json()) < 8 * 1024
    # a world of ranks past 64 missing: the lowest 64 ids, the whole count
    join = StepJoin(RUN, 5.0)
    join.set_world_size(1_000)
    for rank in range(500):
        join.add(step(rank, 4, 1.0))
    (half,) = join.expire(at(10.0))
    assert half.record.missing_count == 500 and half.record.ranks_missing == list(range(500, 564))


def test_a_joined_record_of_an_older_worker_counts_its_lists():
    old = JoinedStep.model_validate_json(
        '{"run_id":"r","step":1,"ts":"2026-01-01T00:00:00Z","world_size":3,"complete":false,'
        '"ranks_reported":[0,2],"ranks_missing":[1]}'
    )
    assert (old.reported_count, old.missing_count) == (2, 1)
    small = StepJoin(RUN)
    small.set_world_size(2)
    small.add(step(0, 1, 0.0))
    (both,) = small.add(step(1, 1, 0.1))
    assert both.record.ranks_reported == [0, 1] and both.record.reported_count == 2
