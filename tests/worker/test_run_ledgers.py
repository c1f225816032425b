"""Issue 35, items 3 and 4, without a broker. A run let go without its end (eviction past ``runs.max_runs``,
silence) keeps what a rollback needs, its checkpoint ledger, and a flood of run ids cannot push a live run
out: eviction takes runs that never stepped, then quiet ones, then those without a confirmed-good checkpoint.
And offsets are one log's: a recreated telemetry log has every event judged, and a snapshot of the old log
is not restored as it is."""

from __future__ import annotations

import math
from datetime import timedelta

from runwatch.contract.schema import CheckpointEvent, RunStartEvent, StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import ProcessResult, TelemetryProcessor
from runwatch.worker.state.run_states import StateOptions
from runwatch.worker.state.snapshot import decode_body, decode_header
from tests.support.state_store import SECRET, STATE_SECRET, T0, WALL, Store

CONFIRM = 8  # policy.confirm_steps: a checkpoint is confirmed good this many healthy steps after it


def _config(**runs) -> RunwatchConfig:
    return RunwatchConfig.model_validate({"runs": runs, "policy": {"confirm_steps": CONFIRM}})


class Worker:
    """A processor with a wall clock the test moves, fed one event at a time at increasing offsets."""

    def __init__(self, config: RunwatchConfig, store: Store | None = None, log_id: str | None = None):
        self.wall = WALL
        self.store = store
        self.offset = 0
        self.proc = TelemetryProcessor(
            config,
            SECRET,
            clock=lambda: self.wall,
            state_reader=store,  # type: ignore[arg-type]
            state=StateOptions(enabled=store is not None, every_events=10_000, interval_s=1e9),
            state_secret=STATE_SECRET if store is not None else None,
        )
        if store is not None:
            self.proc.keep_partitions({0}, log_id)

    def send(self, event) -> ProcessResult:
        self.offset += 1
        result = self.proc.process(
            event.to_json(), key=event.run_id.encode(), partition=0, offset=self.offset
        )
        assert result.deadletter is None, result.deadletter
        return result

    def checkpoint(self) -> None:
        assert self.store is not None
        self.store.write(self.proc.take_snapshots(force_checkpoint=True)[0])


def _healthy_run(worker: Worker, run_id: str, steps: int = 20, first: int = 1, start: bool = True) -> None:
    """A run with a checkpoint at its first step, confirmed good ``CONFIRM`` steps later."""
    if start:
        worker.send(RunStartEvent(run_id=run_id, ts=T0, attempt="a1"))
    for step in range(first, first + steps):
        ts = T0 + timedelta(seconds=step)
        worker.send(StepEvent(run_id=run_id, step=step, loss=1.0, grad_norm=1.0, ts=ts))
        if step == first:
            worker.send(CheckpointEvent(run_id=run_id, step=step, uri=f"/ckpt/{step}.pt", ts=ts))


def _nan_streak(worker: Worker, run_id: str, first: int, steps: int = 3) -> list[tuple[str, str]]:
    """NaN losses from ``first``: the actions issued, (kind, target checkpoint uri or cause)."""
    actions = []
    for step in range(first, first + steps):
        ts = T0 + timedelta(seconds=step)
        result = worker.send(StepEvent(run_id=run_id, step=step, loss=math.nan, ts=ts))
        for a in result.actions:
            target = a.target_checkpoint.uri if a.target_checkpoint else str(a.params.get("cause"))
            actions.append((a.kind, target))
    return actions


# -- item 4: eviction keeps what a rollback needs ----------------------------------------------------


def test_an_evicted_run_comes_back_and_its_nan_still_rolls_back_to_its_confirmed_checkpoint():
    worker = Worker(_config(max_runs=2))
    _healthy_run(worker, "victim")
    worker.wall += timedelta(minutes=10)  # the victim is quiet: the first to go for newcomers
    _healthy_run(worker, "other")
    result = worker.send(StepEvent(run_id="newcomer", step=1, loss=1.0, ts=T0))
    (finding,) = result.anomalies
    assert (finding.run_id, finding.metric, finding.evidence["reason"]) == ("victim", "evicted", "inactive")
    assert "checkpoint ledger and rollback count kept" in finding.message
    assert "victim" not in worker.proc.monitors and worker.proc.counters.ledgers == 1

    worker.wall += timedelta(minutes=1)
    _healthy_run(worker, "victim", steps=3, first=21, start=False)  # back: it takes its ledger on
    # ("newcomer" made room for it: it had no checkpoint, "other" has a confirmed one)
    assert worker.proc.counters.ledgers_resumed == 1 and set(worker.proc.monitors) == {"victim", "other"}
    assert _nan_streak(worker, "victim", 24) == [("alert", "None"), ("rollback", "/ckpt/1.pt")]


def test_a_run_let_go_for_silence_keeps_its_ledger_and_its_spent_rollbacks():
    config = RunwatchConfig.model_validate(
        {"runs": {"silence_retention_s": 600}, "policy": {"confirm_steps": CONFIRM, "max_rollbacks": 1}}
    )
    worker = Worker(config)
    _healthy_run(worker, "quiet")
    assert ("rollback", "/ckpt/1.pt") in _nan_streak(worker, "quiet", 21)  # its one rollback spent
    worker.wall += timedelta(seconds=601)
    (finding,) = worker.proc.tick(worker.wall).anomalies
    assert finding.metric == "silent" and "checkpoint ledger and rollback count kept" in finding.message
    _healthy_run(worker, "quiet", steps=10, first=30, start=False)
    # the budget is not refilled by being let go: the next fault is a stop at the cap
    kinds = [kind for kind, _ in _nan_streak(worker, "quiet", 40)]
    assert "stop" in kinds and "rollback" not in kinds, kinds


def test_a_new_attempt_after_its_run_was_let_go_does_not_take_the_old_ledger():
    worker = Worker(_config(max_runs=1))
    _healthy_run(worker, "job")
    worker.send(StepEvent(run_id="other", step=1, loss=1.0, ts=T0))  # "job" evicted (it was the only one)
    assert worker.proc.counters.ledgers == 1
    worker.send(RunStartEvent(run_id="job", ts=T0, attempt="a2"))  # a requeued job: a fresh run
    assert worker.proc.counters.ledgers_resumed == 0
    assert worker.proc.monitors["job"].checkpoints.good == []


def test_eviction_takes_never_stepped_then_quiet_then_unconfirmed_runs_and_a_flood_leaves_a_live_run_alone():
    worker = Worker(_config(max_runs=50, active_s=300))
    _healthy_run(worker, "live")  # active, with a confirmed-good checkpoint
    worker.send(StepEvent(run_id="quiet", step=1, loss=1.0, ts=T0))
    worker.wall += timedelta(minutes=6)  # "quiet" has been quiet past active_s; "live" goes on
    _healthy_run(worker, "live", steps=2, first=21, start=False)
    worker.send(RunStartEvent(run_id="fresh", ts=T0))  # never stepped, and the most recent of all
    reasons: dict[str, str] = {}
    for i in range(47):  # fill up to the limit with runs that step, no checkpoint
        worker.send(StepEvent(run_id=f"busy-{i}", step=1, loss=1.0, ts=T0))
    assert len(worker.proc.monitors) == 50

    def newcomer(run_id: str, kind: str = "step") -> None:
        event = (
            StepEvent(run_id=run_id, step=1, loss=1.0, ts=T0)
            if kind == "step"
            else RunStartEvent(run_id=run_id, ts=T0)
        )
        for finding in worker.send(event).anomalies:
            reasons[finding.run_id] = finding.evidence["reason"]

    newcomer("n1")
    newcomer("n2")
    newcomer("n3")
    assert reasons == {"fresh": "never_stepped", "quiet": "inactive", "busy-0": "unconfirmed"}
    # A flood of 10,000 run ids, half that never step: the live run with its checkpoint is never taken
    for i in range(10_000):
        newcomer(f"flood-{i}", "step" if i % 2 else "start")
        if i % 1000 == 0:  # the live run goes on
            worker.wall += timedelta(seconds=1)
            step = 23 + i // 1000
            worker.send(StepEvent(run_id="live", step=step, loss=1.0, ts=T0 + timedelta(seconds=step)))
    assert "live" in worker.proc.monitors and "live" not in reasons
    assert len(worker.proc.monitors) == 50
    # (its newest confirmed-good checkpoint: the one at step 21, confirmed during the flood)
    assert _nan_streak(worker, "live", 40) == [("alert", "None"), ("rollback", "/ckpt/21.pt")]


def test_when_every_run_held_is_active_and_confirmed_the_least_recent_goes_with_its_ledger():
    worker = Worker(_config(max_runs=2))
    _healthy_run(worker, "a")
    _healthy_run(worker, "b")
    (finding,) = worker.send(StepEvent(run_id="c", step=1, loss=1.0, ts=T0)).anomalies
    assert (finding.run_id, finding.evidence["reason"]) == ("a", "least_recent")
    assert worker.proc.counters.ledgers == 1


def test_a_let_go_run_s_ledger_is_a_record_that_a_successor_restores_and_that_expires():
    store = Store()
    worker = Worker(_config(max_runs=1, ledger_retention_s=3600), store)
    _healthy_run(worker, "victim")
    worker.send(StepEvent(run_id="other", step=1, loss=1.0, ts=T0))  # "victim" evicted
    worker.checkpoint()
    header, body = decode_header(store.partitions[0]["runwatch-detect/victim"], STATE_SECRET)
    assert header.let_go_at == WALL and [c.uri for c in decode_body(body).good] == ["/ckpt/1.pt"]

    successor = Worker(_config(max_runs=1, ledger_retention_s=3600), store)  # a restart
    assert successor.proc.counters.ledgers == 1 and "victim" not in successor.proc.monitors
    _healthy_run(successor, "victim", steps=3, first=21, start=False)
    assert _nan_streak(successor, "victim", 24) == [("alert", "None"), ("rollback", "/ckpt/1.pt")]

    # one not back within runs.ledger_retention_s: its record is deleted
    late = Worker(_config(max_runs=1, ledger_retention_s=3600), store)
    late.wall += timedelta(hours=2)
    late.proc.tick(late.wall)
    assert late.proc.counters.ledgers == 0
    late.checkpoint()
    assert store.partitions[0]["runwatch-detect/victim"] is None


def test_ledgers_are_bounded_by_max_ledgers_the_oldest_going_first():
    store = Store()
    worker = Worker(_config(max_runs=1, max_ledgers=2), store)
    for run in ("r1", "r2", "r3", "r4"):
        _healthy_run(worker, run)  # each pushes the one before out, with its ledger
    assert worker.proc.counters.ledgers == 2 and set(worker.proc._ledgers) == {"r2", "r3"}
    worker.checkpoint()
    assert store.partitions[0]["runwatch-detect/r1"] is None


# -- item 3: offsets belong to the log they came from ------------------------------------------------


def test_a_recreated_log_has_every_event_judged_and_the_runs_snapshotted_with_new_positions():
    store = Store()
    worker = Worker(_config(), store, log_id="log-a")
    _healthy_run(worker, "r", steps=200)
    worker.checkpoint()  # the run's snapshot at offset ~202 of log A
    assert decode_header(store.partitions[0]["runwatch-detect/r"], STATE_SECRET)[0].offset == worker.offset

    # The topic is recreated (log B): the worker reads it from offset 0
    assert worker.proc.log_recreated({0}, "log-b") == []  # the run was fed here: its state is kept
    assert worker.proc.counters.logs_recreated == 1 and "r" in worker.proc.monitors
    worker.offset = 0
    _healthy_run(worker, "r", steps=3, first=201, start=False)
    # every event of log B judged (none taken for one the snapshot at ~202 includes): the NaN rolls back
    assert _nan_streak(worker, "r", 204) == [("alert", "None"), ("rollback", "/ckpt/1.pt")]
    worker.checkpoint()
    header, _ = decode_header(store.partitions[0]["runwatch-detect/r"], STATE_SECRET)
    assert (header.offset, header.log_id) == (worker.offset, "log-b")


def test_a_snapshot_of_another_log_is_not_restored_but_its_ledger_is_kept():
    store = Store()
    worker = Worker(_config(), store, log_id="log-a")
    _healthy_run(worker, "r", steps=200)
    worker.checkpoint()

    successor = Worker(_config(), store, log_id="log-b")  # the topic was recreated before it started
    assert "r" not in successor.proc.monitors
    assert successor.proc.counters.stale_snapshots == 1 and successor.proc.counters.ledgers == 1
    _healthy_run(successor, "r", steps=3, first=201, start=False)  # log B from offset 1: all judged
    assert _nan_streak(successor, "r", 204) == [("alert", "None"), ("rollback", "/ckpt/1.pt")]

    same = Worker(_config(), store, log_id="log-b")  # its own snapshots (log B's) are restored
    successor.checkpoint()
    same = Worker(_config(), store, log_id="log-b")
    assert "r" in same.proc.monitors and same.proc.counters.stale_snapshots == 0


def test_without_topic_ids_a_restored_run_fed_nothing_before_its_log_was_found_recreated_is_dropped():
    store = Store()
    worker = Worker(_config(), store)  # a broker that reports no topic ids
    _healthy_run(worker, "r", steps=200)
    worker.checkpoint()
    successor = Worker(_config(), store)
    assert "r" in successor.proc.monitors  # restored: its snapshot names no log to check
    # its committed position lies past the end of the log: the log was recreated
    assert successor.proc.log_recreated({0}) == ["r"]
    assert "r" not in successor.proc.monitors and successor.proc.counters.stale_snapshots == 1
    successor.offset = 0
    _healthy_run(successor, "r", steps=3, first=201, start=False)
    assert _nan_streak(successor, "r", 204) == [("alert", "None"), ("rollback", "/ckpt/1.pt")]


# -- issue 39: a crash's history outlives the worker ---------------------------------------------------


def _segfault(worker: Worker, run_id: str, step: int, host: str) -> list[str]:
    """A rank's launcher reports a SIGSEGV at ``step``; the action kinds issued."""
    from runwatch.contract.schema import CrashEvent

    ts = T0 + timedelta(seconds=step, milliseconds=500)
    crash = CrashEvent(run_id=run_id, ts=ts, source="launcher", signal=11, host=host, step=step)
    result = worker.send(crash)
    return [a.kind for a in result.actions]


def _restored(store: Store, config: RunwatchConfig) -> Worker:
    """A worker started after the last one died: it restores the partition from the state records."""
    return Worker(config, store)  # (it takes partition 0 over: restored from the records)


def test_the_same_crash_twice_is_not_restarted_a_third_time_across_a_worker_restart():
    store = Store()
    first = Worker(_config(), store)
    _healthy_run(first, "crashy", steps=10)
    assert _segfault(first, "crashy", 10, "n1") == ["restart"]
    from runwatch.contract.schema import RunEndEvent

    first.send(RunEndEvent(run_id="crashy", ts=T0 + timedelta(seconds=11), status="failed"))
    first.checkpoint()  # the ended run's marker carries what its crashes left
    # the worker dies; the next attempt meets a fresh one, which read the marker
    second = _restored(store, _config())
    second.send(RunStartEvent(run_id="crashy", ts=T0 + timedelta(seconds=60), attempt="a2"))
    assert _segfault(second, "crashy", 10, "n2") == ["stop"]
