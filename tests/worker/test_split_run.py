"""A run split by rank group (issue 36), without a broker: the groups' partials merge into the same joined
step as one join of every rank; a split run's fault gives one action; a forged report, a rank that claims
another group and events that disagree on the run's shape are dead-lettered while the run goes on."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.group_report import ReportBody
from runwatch.contract.groups import group_key, group_ranks, parse_key, record_key
from runwatch.contract.schema import (
    CategoryLoss,
    CheckpointEvent,
    GroupReport,
    MemoryStats,
    RunEndEvent,
    RunStartEvent,
    SchemaError,
    StepEvent,
    decode_event,
)
from runwatch.contract.signing import ActionSigningKey
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.group_join import GroupJoin
from runwatch.detectors.engine.rank_join import StepJoin
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import SEED

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
WALL = T0 + timedelta(hours=6)


def _event(rng: random.Random, rank: int, step: int, **extra: object) -> StepEvent:
    return StepEvent(
        run_id="big",
        rank=rank,
        step=step,
        ts=T0 + timedelta(seconds=step, milliseconds=rank),
        loss=rng.uniform(1, 3),
        lr=[0.1],
        grad_norm=rng.uniform(0.5, 2),
        param_norm=rng.uniform(10, 20),
        update_norm=rng.uniform(0.01, 0.1),
        module_grad_norms={"a": rng.uniform(0, 1), "b": rng.uniform(0, 1)},
        category_loss={"x": CategoryLoss(mean=rng.uniform(1, 2), count=rng.randint(1, 9))},
        module_activations={"relu": {"rms": rng.uniform(0.5, 2), "zero_frac": rng.uniform(0.3, 0.6)}},
        step_time_s=rng.uniform(0.9, 1.1),
        compute_s=rng.uniform(0.5, 0.8),
        samples_per_s=rng.uniform(30, 40),
        memory=MemoryStats(allocated=rng.randint(1, 10**9)),
        nonfinite_grads=0,
        **extra,
    )


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("nan_rank", [None, 6])
def test_merged_group_partials_make_the_joined_step_one_join_of_every_rank_makes(sharded, nan_rank):
    rng = random.Random(7)
    world, size = 11, 4
    events = [_event(rng, r, 3, grad_sharded=sharded or None) for r in range(world)]
    if nan_rank is not None:
        events[nan_rank] = events[nan_rank].model_copy(update={"loss": math.nan, "grad_norm": math.nan})
    absent = {9}  # one rank of the last group never reports: every join times out without it
    whole = StepJoin("big", timeout_s=5)
    whole.set_world_size(world)
    partials = []
    for group in range(3):
        join = StepJoin("big", timeout_s=5)
        join.set_ranks(group_ranks(group, size, world))
        out = []
        for e in events:
            if e.rank in group_ranks(group, size, world) and e.rank not in absent:
                out += join.add(e)
        out += join.expire(T0 + timedelta(seconds=60))
        [joined] = out
        partials.append(joined.partial)
    expected = []
    for e in events:
        if e.rank not in absent:
            expected += whole.add(e)
    expected += whole.expire(T0 + timedelta(seconds=60))
    [one] = expected

    groups = GroupJoin("big", timeout_s=5)
    groups.set_shape(world, size)
    merged = []
    for group, partial in enumerate(partials):
        merged += groups.add(group, partial)
    [split] = merged

    def same(a: object, b: object) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    for name in ("loss", "grad_norm", "param_norm", "update_norm", "step_time_s", "samples_per_s", "memory"):
        assert same(getattr(split.event, name), getattr(one.event, name)), name
    assert same(split.event.module_grad_norms, one.event.module_grad_norms)
    # activations: the root mean square of the ranks' rms, the largest zero fraction
    present = [e for e in events if e.rank not in absent]
    for joined in (split.event, one.event):
        relu = joined.module_activations["relu"]
        assert relu.rms == pytest.approx(
            math.sqrt(sum(e.module_activations["relu"].rms ** 2 for e in present) / len(present))
        )
        assert relu.zero_frac == max(e.module_activations["relu"].zero_frac for e in present)
    [(name, c)] = split.event.category_loss.items()
    [(name_one, c_one)] = one.event.category_loss.items()
    assert (name, c.count) == (name_one, c_one.count) and c.mean == pytest.approx(c_one.mean)
    for name in ("world_size", "complete", "ranks_missing", "missing_count", "reported_count"):
        assert getattr(split.record, name) == getattr(one.record, name), name
    for name in ("step_time_max_rank", "compute_max_rank", "memory_max_rank", "memory_min_rank"):
        assert getattr(split.record, name) == getattr(one.record, name), name
    assert split.record.ranks_missing == [9] and not split.record.complete


def test_a_partial_and_the_joined_record_stay_small_at_16384_ranks():
    rng = random.Random(1)
    size = 256
    join = StepJoin("big")
    join.set_ranks(group_ranks(10, size, 16_384))
    [joined] = [j for e in (_event(rng, r, 0) for r in group_ranks(10, size, 16_384)) for j in join.add(e)]
    partial = joined.partial
    assert len(partial.model_dump_json()) < 2_000
    groups = GroupJoin("big")
    groups.set_shape(16_384, size)
    out = []
    for g in range(64):
        out += groups.add(g, partial.model_copy(update={"first_rank": g * size}))
    [step] = out
    assert step.record.reported_count == 64 * 256
    assert len(step.record.to_json()) <= 8_000


def test_keys_of_a_split_run():
    assert record_key("run-1") == b"run-1"
    assert record_key("run-1", 600, 256) == b"run-1#2"
    assert parse_key(group_key("a#b", 3)) == ("a#b", 3) and parse_key("run-1") == ("run-1", None)


def _raw(rank: int, step: int = 0, group_size: int = 4, world: int = 8, **fields: object) -> bytes:
    return StepEvent(
        run_id="big", rank=rank, step=step, loss=1.0, group_size=group_size, world_size=world, ts=T0, **fields
    ).to_json()


def test_a_rank_that_claims_another_group_is_refused_with_the_reason():
    decode_event(_raw(5), key=b"big#1")
    with pytest.raises(SchemaError, match="rank 5 claims group 0; with group_size 4 it is in group 1"):
        decode_event(_raw(5), key=b"big#0")
    with pytest.raises(SchemaError, match="does not match run_id"):
        decode_event(_raw(5), key=b"big")
    with pytest.raises(SchemaError, match="outside the run's world of 8"):
        decode_event(_raw(9, world=8), key=b"big#2")
    with pytest.raises(SchemaError, match="without world_size"):
        decode_event(StepEvent(run_id="big", rank=1, step=0, group_size=4, ts=T0).to_json(), key=b"big#0")


class _Split:
    """Two stages in one processor: a group's reports are read back as the broker would hand them over."""

    def __init__(self) -> None:
        config = RunwatchConfig.model_validate({"policy": {"confirm_steps": 6}})
        self.proc = TelemetryProcessor(config, SEED, clock=lambda: WALL)
        self.offset = 0
        self.actions: list = []
        self.anomalies: list = []
        self.joined: list = []
        self.letters: list = []

    def send(self, raw: bytes, key: bytes) -> None:
        self.offset += 1
        result = self.proc.process(raw, key, None, self.offset, None)
        if result.deadletter is not None:
            self.letters.append(result.deadletter.reason)
        self.actions += result.actions
        self.anomalies += result.anomalies
        self.joined += result.joined
        for report in result.reports:
            self.send(report.to_json(), report.run_id.encode())


def test_a_nan_on_one_rank_of_a_split_run_gives_one_rollback_and_its_groups_merge():
    run = _Split()
    start = RunStartEvent(run_id="big", world_size=8, group_size=4, ts=T0, attempt="a1")
    run.send(start.to_json(), b"big#0")
    for step in range(14):
        for rank in range(8):
            loss = math.nan if rank == 5 and step >= 10 else 2.0 - 0.01 * step
            raw = StepEvent(
                run_id="big",
                rank=rank,
                step=step,
                loss=loss,
                grad_norm=1.0,
                group_size=4,
                world_size=8,
                ts=T0 + timedelta(seconds=step),
            ).to_json()
            run.send(raw, record_key("big", rank, 4))
        if step == 2:
            ckpt = CheckpointEvent(
                run_id="big", step=2, uri="/c/2", group_size=4, world_size=8, ts=T0 + timedelta(seconds=2)
            )
            run.send(ckpt.to_json(), b"big#0")
    assert run.letters == []
    assert [j.step for j in run.joined] == list(range(14))
    assert all(j.world_size == 8 and j.reported_count == 8 for j in run.joined)
    assert math.isnan(run.joined[10].loss_mean) and run.joined[9].loss_mean == pytest.approx(1.91)
    # as the same run unsplit: an alert at the first non-finite step, one rollback at the third
    assert [a.kind for a in run.actions] == ["alert", "rollback"], run.actions
    assert run.actions[1].target_checkpoint is not None and run.actions[1].target_checkpoint.step == 2
    assert {a.run_id for a in run.anomalies} == {"big"}
    assert {"big", "big#0", "big#1"} == set(run.proc.monitors)
    # each group joins its own ranks, run_start or not (a handler of the group's, not the whole run's)
    group0, group1 = run.proc.monitors["big#0"], run.proc.monitors["big#1"]
    assert (group0.join.first_rank, group0.join.world_size) == (0, 4) and group0.started
    assert (group1.join.first_rank, group1.join.world_size) == (4, 8)
    assert group0.join.joined == group1.join.joined == 14


def test_forged_and_disagreeing_events_are_dead_lettered_and_the_run_goes_on():
    run = _Split()
    forger = ActionSigningKey.generate()  # not the workers' key
    body = ReportBody(group_size=4, world_size=8).model_dump_json()
    forged = GroupReport(run_id="big", group=0, body=body, signature=forger.sign_report(body), ts=WALL)
    run.send(forged.to_json(), b"big")
    assert run.letters and "not signed by the workers' key" in run.letters[-1]
    unsigned = GroupReport(run_id="big", group=0, body=body, signature="", ts=WALL)
    run.send(unsigned.to_json(), b"big")
    assert "not signed" in run.letters[-1]

    for rank in range(4):  # group 0 joins step 0 and reports: the run's own monitor is 4/8
        run.send(_raw(rank, step=0), b"big#0")
    assert "big" in run.proc.monitors and len(run.joined) == 0  # (waiting for group 1)
    run.send(_raw(1, step=1, group_size=2), b"big#0")  # (rank 1 of groups of 2: group 0 too)
    assert "group_size/world_size: 2/8 disagrees with the run's 4/8" in run.letters[-1]
    run.send(_raw(2, step=1, world=12), b"big#0")
    assert "4/12 disagrees with the run's 4/8" in run.letters[-1]
    letters = len(run.letters)
    for rank in range(4, 8):  # a group that disagrees with the others: its report is refused where they merge
        run.send(_raw(rank, step=0, world=12), b"big#1")
    assert len(run.letters) == letters + 1 and "group_report" not in run.letters[-1]
    assert "4/12 disagrees with the run's 4/8" in run.letters[-1]
    letters = len(run.letters)
    for rank in range(4):  # the run goes on: group 0's next step is taken
        run.send(_raw(rank, step=1), b"big#0")
    assert len(run.letters) == letters
    assert run.proc.monitors["big#0"].join.last_key(3) == (0, 1)


def test_a_runs_groups_fill_the_partitions_in_turn():
    from runwatch.contract.topics import group_partition, key_partition

    for run_id in ("run-a", "run-b", "x" * 200):
        first = key_partition(run_id.encode(), 8)
        placed = [key_partition(group_key(run_id, g).encode(), 8) for g in range(64)]
        assert placed == [(first + g) % 8 for g in range(64)]  # 8 groups on every partition
        assert group_partition(group_key(run_id, 3).encode(), 8) == (first + 3) % 8
        assert group_partition(run_id.encode(), 8) is None  # (the client's own murmur2)
    # a run's own key is placed as every Kafka client places it (murmur2): old producers are unchanged
    from kafka.partitioner.default import murmur2

    assert key_partition(b"run-a", 8) == (murmur2(b"run-a") & 0x7FFFFFFF) % 8


def test_a_split_runs_monitors_are_restored_from_their_snapshots():
    import pickle
    import zlib

    from runwatch.worker.processor import RunState
    from runwatch.worker.state.snapshot import decode_body

    run = _Split()
    for step in range(3):
        for rank in range(6):  # group 1 is missing ranks 6 and 7: its steps wait, partials pending
            run.send(_raw(rank, step=step), record_key("big", rank, 4))
    for key in ("big", "big#0", "big#1"):
        monitor = run.proc.monitors[key]
        body = zlib.compress(pickle.dumps(RunState(monitor, None), protocol=pickle.HIGHEST_PROTOCOL))
        restored = decode_body(memoryview(body)).monitor  # (the restricted unpickler: only admitted names)
        assert type(restored) is type(monitor) and restored.run_id == "big"
        assert getattr(restored, "shape", None) == (4, 8)
    assert (
        len(decode_body(memoryview(zlib.compress(pickle.dumps(run.proc.monitors["big"])))).groups._pending)
        == 3
    )


def test_each_groups_first_rank_says_when_the_run_starts_and_ends(tmp_path, monkeypatch):
    import json

    from runwatch.producer.publish.recorder import JsonlRecorder

    monkeypatch.setenv("RUNWATCH_GROUP_SIZE", "4")
    kinds = {}
    for rank in (0, 4, 5):
        path = tmp_path / f"rank{rank}.jsonl"
        with JsonlRecorder(path, "big", rank, world_size=8, collect_metadata=False) as rw:
            rw.step(0, loss=1.0)
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert {(e["group_size"], e["world_size"]) for e in events} == {(4, 8)}
        kinds[rank] = [e["kind"] for e in events]
    assert kinds == {0: ["run_start", "step", "run_end"], 4: ["run_start", "step", "run_end"], 5: ["step"]}


def test_a_groups_start_and_end_stay_with_it_and_end_it():
    run = _Split()
    for rank in (0, 4):  # the run's start (rank 0) and group 1's (its first rank)
        start = RunStartEvent(run_id="big", rank=rank, world_size=8, group_size=4, ts=T0, attempt="a1")
        run.send(start.to_json(), record_key("big", rank, 4))
    for rank in range(8):
        run.send(_raw(rank, step=0), record_key("big", rank, 4))
    merged = run.proc.monitors["big"]
    assert merged.started and merged.attempt == "a1" and run.proc.monitors["big#1"].started
    assert merged.events_seen == 1  # rank 0's run_start only: group 1's start stayed with group 1
    for rank in (0, 4):
        end = RunEndEvent(run_id="big", rank=rank, group_size=4, world_size=8, ts=T0 + timedelta(seconds=1))
        run.send(end.to_json(), record_key("big", rank, 4))
    assert run.proc.monitors["big#1"].ended_at is not None and merged.ended_at is not None
    assert merged.events_seen == 2
    # a join timeout later, every key of the run is let go (not held for hours of silence)
    run.proc._clock = lambda: WALL + timedelta(minutes=5)
    run.proc.tick(now=WALL + timedelta(minutes=5))
    assert run.proc.monitors == {}


def test_a_group_of_one_rank_reports_its_steps():
    run = _Split()
    for step in range(2):
        for rank in range(5):  # groups of 4 in a world of 5: group 1 is rank 4 alone
            run.send(_raw(rank, step=step, world=5), record_key("big", rank, 4))
    assert [(j.step, j.reported_count, j.world_size) for j in run.joined] == [(0, 5, 5), (1, 5, 5)]


def test_a_run_restarted_whole_after_it_was_split_is_watched_whole():
    run = _Split()
    for rank in range(8):
        run.send(_raw(rank, step=0), record_key("big", rank, 4))
    assert type(run.proc.monitors["big"]).__name__ == "RunMergeMonitor"
    run.send(
        _raw(0, step=1, group_size=None, world=None), b"big"
    )  # (a whole run's step: refused while split)
    assert "is split by rank group" in run.letters[-1]
    # the job comes back with fewer ranks, not split: its run_start starts it whole
    start = RunStartEvent(run_id="big", world_size=2, ts=T0 + timedelta(seconds=5), attempt="a2")
    run.send(start.to_json(), b"big")
    letters = len(run.letters)
    for rank in range(2):
        run.send(_raw(rank, step=0, group_size=None, world=None), b"big")
    assert len(run.letters) == letters
    assert (
        type(run.proc.monitors["big"]).__name__ == "RunMonitor" and run.proc.monitors["big"].attempt == "a2"
    )


def test_a_silent_group_is_let_go_under_its_runs_id():
    run = _Split()
    for rank in range(4):
        run.send(_raw(rank, step=0), record_key("big", rank, 4))
    later = WALL + timedelta(days=1)
    run.proc._clock = lambda: later
    result = run.proc.tick(now=later)
    let_go = [a for a in result.anomalies if a.detector != "straggler"]
    assert let_go and {a.run_id for a in let_go} == {"big"}
    assert "big#0" not in run.proc.monitors
