"""Per-run state snapshots (issue 16), without a broker: the processor's results are the same whichever
processor holds a run and however often it moves (cut anywhere, restored from the snapshots written so
far, the backlog replayed from the last checkpoint), nothing is issued twice by a successor, a restored
run keeps its baseline, and a run let go leaves no snapshot to restore."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta

from runwatch.contract.schema import (
    ActionAckEvent,
    CheckpointEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import ProcessResult, TelemetryProcessor
from runwatch.worker.state.run_states import StateOptions
from tests.support.state_store import SECRET, STATE_SECRET, T0, WALL, Store

# -- the same results however often a run moves ----------------------------------------------------


CONFIG = RunwatchConfig.model_validate({"policy": {"confirm_steps": 12}})


def _stream(seed: int = 7) -> list[tuple[int, int, bytes]]:
    """(partition, offset, raw) in arrival order: three runs on two partitions, two ranks each, noisy
    steps, checkpoints, a loss spike, four NaN steps that roll back (acknowledged, the steps replayed), a run
    end."""
    rng = random.Random(seed)
    by_run: dict[str, list[bytes]] = {}
    for run_id, fault in (("run-a", "spike"), ("run-b", "nan"), ("run-c", None)):
        events: list[bytes] = [
            RunStartEvent(run_id=run_id, world_size=2, ts=T0, event_id=f"{run_id}-start").to_json()
        ]
        t = 0
        steps = list(range(0, 80))
        if fault == "nan":
            steps = list(range(0, 56)) + list(range(41, 80))  # rolled back to 40 after the NaN at 55
        for i, step in enumerate(steps):
            t += 1
            for rank in (0, 1):
                loss = 2.0 * 0.99**step + rng.gauss(0, 0.02)
                if fault == "spike" and step == 50:
                    loss *= 6
                if fault == "nan" and 52 <= step <= 55 and i < 56:
                    loss = float("nan")
                events.append(
                    StepEvent(
                        run_id=run_id,
                        rank=rank,
                        step=step,
                        loss=loss,
                        grad_norm=1.0 + rng.gauss(0, 0.05),
                        step_time_s=0.1 + rng.gauss(0, 0.003),
                        ts=T0 + timedelta(seconds=t),
                        event_id=f"{run_id}-{i}-{rank}",
                    ).to_json()
                )
            if step % 10 == 0 and step > 0 and i < 56:
                events.append(
                    CheckpointEvent(
                        run_id=run_id,
                        step=step,
                        uri=f"/c/{step}",
                        ts=T0 + timedelta(seconds=t),
                        event_id=f"{run_id}-ckpt-{i}",
                    ).to_json()
                )
            if fault == "nan" and i == 56:
                events.append(
                    ActionAckEvent(
                        run_id=run_id,
                        action_id="filled-below",
                        outcome="applied",
                        step=55,
                        to_step=40,
                        ts=T0 + timedelta(seconds=t),
                        event_id=f"{run_id}-ack",
                    ).to_json()
                )
        if run_id == "run-c":
            events.append(
                RunEndEvent(
                    run_id=run_id, ts=T0 + timedelta(seconds=t + 1), event_id=f"{run_id}-end"
                ).to_json()
            )
        by_run[run_id] = events
    partition_of = {"run-a": 0, "run-b": 1, "run-c": 0}
    offsets = {0: 0, 1: 0}
    out = []
    cursors = dict.fromkeys(by_run, 0)
    while any(cursors[r] < len(by_run[r]) for r in by_run):
        run_id = rng.choice([r for r in by_run if cursors[r] < len(by_run[r])])
        p = partition_of[run_id]
        out.append((p, offsets[p], by_run[run_id][cursors[run_id]]))
        offsets[p] += 1
        cursors[run_id] += 1
    return out


def _with_rollback_ack(stream: list[tuple[int, int, bytes]], action_id: str) -> list[tuple[int, int, bytes]]:
    return [(p, o, raw.replace(b'"filled-below"', json.dumps(action_id).encode())) for p, o, raw in stream]


def _findings(results: list[ProcessResult]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Anomalies by id (their content, without detected_at) and actions by id (every copy issued)."""
    anomalies: dict[str, str] = {}
    actions: dict[str, list[str]] = {}
    for result in results:
        for a in result.anomalies:
            body = a.model_dump_json(exclude={"detected_at"})
            assert anomalies.setdefault(a.anomaly_id, body) == body, f"{a.anomaly_id} came back changed"
        for act in result.actions:
            actions.setdefault(act.action_id, []).append(
                act.model_dump_json(exclude={"issued_at", "expires_at", "signature"})
            )
    return anomalies, actions


def _processor(store: Store, wall: datetime = WALL) -> TelemetryProcessor:
    return TelemetryProcessor(
        CONFIG,
        SECRET,
        clock=lambda: wall,
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=25, interval_s=1e9),
        state_secret=STATE_SECRET,
    )


def _run(
    stream, cuts: set[int], batch: int = 10, snapshot_lost: bool = False
) -> tuple[list[ProcessResult], int]:
    """Feed ``stream`` in batches, as the worker does; at each cut index the processor is lost and a new
    one restores from the store and reads again from the last checkpoint. ``snapshot_lost``: the batch
    before each cut had its results published but its snapshots never reached the store (the worker
    died between the two). Returns the results and how many runs were restored in all."""
    store = Store()
    proc = _processor(store)
    proc.keep_partitions({0, 1})
    results: list[ProcessResult] = []
    committed = 0  # index of the first event not covered by a delivered checkpoint
    i = 0
    pending = sorted(cuts)
    restored = 0
    while i < len(stream):
        if pending and i >= pending[0]:
            pending.pop(0)
            restored += proc.counters.restored_runs
            proc = _processor(store)  # the successor: nothing in memory
            proc.keep_partitions({0, 1})
            i = committed
            continue
        chunk = stream[i : min(i + batch, pending[0] if pending else len(stream))]
        for p, o, raw in chunk:
            results.append(proc.process(raw, key=json.loads(raw)["run_id"].encode(), partition=p, offset=o))
            store.publish(results[-1])
        checkpoint_now = (i // batch) % 3 == 2  # every third batch, as the interval would
        records, checkpoint = proc.take_snapshots(force_checkpoint=checkpoint_now)
        i += len(chunk)
        if snapshot_lost and pending and i == pending[0]:
            continue
        store.write(records)
        if checkpoint:
            committed = i
    return results, restored + proc.counters.restored_runs


def test_results_are_the_same_whichever_processor_holds_the_run_and_however_often_it_moves():
    draft = _stream()
    first, _ = _run(draft, set())
    rollbacks = [a for r in first for a in r.actions if a.kind == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].run_id == "run-b"
    stream = _with_rollback_ack(draft, rollbacks[0].action_id)

    uninterrupted, _ = _run(stream, set())
    want_anomalies, want_actions = _findings(uninterrupted)
    assert {a.split("|")[0] for a in want_actions} and len(want_anomalies) >= 2
    detectors = {json.loads(v)["detector"] for v in want_anomalies.values()}
    assert {"non_finite", "loss_spike"} <= detectors, detectors

    # lost right after each action was issued (before a checkpoint covered it), and at assorted places
    right_after = {i + 1 for i, r in enumerate(uninterrupted) if r.actions}
    for cuts in (
        right_after,
        {45},
        {101, 230},
        {17, 64, 65, 150, 260, 330, 400},
        set(range(20, len(stream), 37)),
    ):
        moved, restored = _run(stream, cuts)
        anomalies, actions = _findings(moved)
        assert anomalies == want_anomalies, cuts
        assert {k: v[:1] for k, v in actions.items()} == {k: v[:1] for k, v in want_actions.items()}, cuts
        # an action is issued once: it is snapshotted with the state that decided it
        assert all(len(copies) == 1 for copies in actions.values()), cuts
        # (each successor restored the runs, not rebuilt them)
        assert restored >= 2 * len(cuts), (cuts, restored)


def test_a_successor_does_not_issue_again_what_its_predecessor_published_after_its_last_snapshot():
    """The worker died after the broker took an action and before it took the snapshot sent after it:
    the successor restores the snapshot before, replays, decides the action again, and finds it
    already on the action topic (worker/runwatch/worker/state/published.py). Without that read it is issued
    twice."""
    draft = _stream()
    first, _ = _run(draft, set())
    stream = _with_rollback_ack(
        draft, next(a for r in first for a in r.actions if a.kind == "rollback").action_id
    )
    uninterrupted, _ = _run(stream, set())
    want_anomalies, want_actions = _findings(uninterrupted)
    right_after = {i + 1 for i, r in enumerate(uninterrupted) if r.actions or r.anomalies}
    moved, _ = _run(stream, right_after, batch=1, snapshot_lost=True)
    anomalies, actions = _findings(moved)
    assert anomalies == want_anomalies
    assert {k: v[:1] for k, v in actions.items()} == {k: v[:1] for k, v in want_actions.items()}
    assert all(len(copies) == 1 for copies in actions.values()), {k: len(v) for k, v in actions.items()}
    anomaly_copies = [a.anomaly_id for r in moved for a in r.anomalies]
    assert len(anomaly_copies) == len(set(anomaly_copies))  # (no finding published twice either)


# -- what a restored run keeps, and what a run let go leaves ---------------------------------------


def test_a_restored_run_keeps_its_baseline_band_and_the_history_its_end_is_judged_against():
    from runwatch.detectors.baseline_trajectory import BaselineTrajectoryDetector, hand_band
    from runwatch.detectors.baselines.summary import RunSummarizer
    from tests.detectors.test_baseline_trajectory import BAND, run  # a band of five seeded runs of one job

    store = Store()
    events = run(9, run_id="live")
    wall = events[-1].ts + timedelta(hours=1)
    first = _processor(store, wall)
    first.keep_partitions({0})
    first.process(RunStartEvent(run_id="live", ts=events[0].ts).to_json(), key=b"live", partition=0, offset=0)
    monitor = first.monitors["live"]
    history = [RunSummarizer(f"old-{i}").summary() for i in range(3)]
    monitor.set_history(history, None)  # what the worker's BaselineLoader hands over at run_start
    hand_band(monitor.joined_detectors, BAND, None)
    for offset, event in enumerate(events[:50], start=1):
        first.process(event.to_json(), key=b"live", partition=0, offset=offset)
    records, _ = first.take_snapshots(force_checkpoint=True)
    store.write(records)

    second = _processor(store, wall)
    second.keep_partitions({0})
    restored = second.monitors["live"]
    assert [s.run_id for s in restored.baseline.candidates] == ["old-0", "old-1", "old-2"]
    (trajectory,) = [d for d in restored.joined_detectors if isinstance(d, BaselineTrajectoryDetector)]
    (before,) = [d for d in monitor.joined_detectors if isinstance(d, BaselineTrajectoryDetector)]
    assert trajectory._band.names == before._band.names and trajectory._band.names
    import numpy as np

    assert np.array_equal(trajectory._band.thr, before._band.thr, equal_nan=True)


def test_a_run_let_go_has_its_snapshot_deleted_so_no_successor_restores_it():
    store = Store()
    wall = [WALL]
    config = RunwatchConfig.model_validate(
        {"runs": {"silence_retention_s": 60, "max_runs": 2}, "policy": {"confirm_steps": 12}}
    )
    proc = TelemetryProcessor(
        config,
        SECRET,
        clock=lambda: wall[0],
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=25, interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    proc.keep_partitions({0})
    for i, run in enumerate(("crashed", "evicted", "live")):
        wall[0] = WALL + timedelta(seconds=i)
        ts = WALL - timedelta(seconds=10)
        proc.process(
            StepEvent(run_id=run, step=1, loss=1.0, ts=ts).to_json(), key=run.encode(), partition=0, offset=i
        )
        if i == 1:
            store.write(proc.take_snapshots(force_checkpoint=True)[0])  # both snapshotted...
    assert {"crashed", "evicted"} <= {k.split("/", 1)[1] for k in store.read({0})}
    # ... then "crashed" was evicted to make room for "live" (max_runs 2); "evicted" goes silent
    wall[0] = WALL + timedelta(seconds=62)
    proc.process(
        StepEvent(run_id="live", step=2, loss=1.0, ts=WALL).to_json(), key=b"live", partition=0, offset=3
    )
    let_go = proc.tick(wall[0]).anomalies
    assert [(a.run_id, a.metric) for a in let_go] == [("evicted", "silent")]
    store.write(proc.take_snapshots(force_checkpoint=True)[0])
    held = {k.split("/", 1)[1]: v for k, v in store.read({0}).items()}
    assert held["crashed"] is None and held["evicted"] is None and held["live"] is not None  # tombstones
    successor = TelemetryProcessor(
        config,
        SECRET,
        clock=lambda: wall[0],
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=25, interval_s=1e9),
        state_secret=STATE_SECRET,
    )
    successor.keep_partitions({0})
    assert set(successor.monitors) == {"live"}
