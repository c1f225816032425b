"""A run's summary row, built from its events as the worker and the offline ingest see them."""

from __future__ import annotations

import pickle
import random
import statistics
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import (
    ActionAckEvent,
    Anomaly,
    CategoryLoss,
    EvalEvent,
    MemoryStats,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)
from runwatch.detectors.baselines.compare import BaselineConfig, compare_run, outliers
from runwatch.detectors.baselines.summary import RunSummarizer, hardware_fingerprint

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def run_events(
    run_id: str = "r1",
    steps: int = 300,
    step_time: float = 0.2,
    seed: int = 0,
    end: bool = True,
    gpus: tuple[str, ...] = ("H100", "H100"),
) -> list:
    rng = random.Random(seed)
    events: list = [
        RunStartEvent(
            run_id=run_id,
            ts=T0,
            world_size=2,
            gpu_names=list(gpus),
            torch_version="2.13.0",
            cuda_version="12.8",
            baseline_key="job-a",
            git_sha="abc123",
            git_dirty=False,
            config_hash="cfg1",
            dataset_version="v3",
        )
    ]
    ts = T0
    for step in range(steps):
        dt = step_time * (1 + rng.gauss(0, 0.05))
        ts += timedelta(seconds=dt)
        events.append(
            StepEvent(
                run_id=run_id,
                step=step,
                ts=ts,
                loss=2.0 - step / steps,
                step_time_s=dt,
                data_wait_s=0.1 * dt,
                samples_per_s=64 / dt,
                mfu=0.4,
                memory=MemoryStats(
                    allocated=10**9 + step, reserved=2 * 10**9, peak=10**9 + 2 * step, host_rss=5 * 10**8
                ),
                category_loss={"speech": CategoryLoss(mean=1.0 + step / 1000, count=8)},
            )
        )
        if step % 100 == 99:
            events.append(EvalEvent(run_id=run_id, step=step, ts=ts, loss=[1.5, 1.2, 1.3][step // 100 % 3]))
    events.append(
        ActionAckEvent(
            run_id=run_id,
            rank=0,
            ts=ts,
            action_id="a1",
            action_kind="rollback",
            outcome="applied",
            to_step=100,
        )
    )
    events.append(
        ActionAckEvent(
            run_id=run_id,
            rank=1,
            ts=ts,
            action_id="a1",
            action_kind="rollback",
            outcome="applied",
            to_step=100,
        )
    )  # the other rank's ack of the same rollback
    events.append(
        ActionAckEvent(run_id=run_id, ts=ts, action_id="a2", action_kind="rollback", outcome="failed")
    )
    if end:
        events.append(RunEndEvent(run_id=run_id, ts=ts + timedelta(seconds=1), status="completed"))
    return events


def summarize(events: list, **kwargs) -> RunSummarizer:
    s = RunSummarizer(events[0].run_id, **kwargs)
    for e in events:
        s.observe(e)
    return s


def test_the_summary_has_the_runs_identity_and_figures():
    events = run_events()
    s = summarize(events)
    s.add_anomaly(
        Anomaly(
            anomaly_id="x",
            run_id="r1",
            step=5,
            detector="loss_spike",
            metric="loss",
            value=1.0,
            threshold=0.5,
            score=2.0,
            severity="warning",
            message="m",
            ts=T0,
        )
    )
    row = s.summary()
    assert (row.baseline_key, row.git_sha, row.config_hash, row.dataset_version) == (
        "job-a",
        "abc123",
        "cfg1",
        "v3",
    )
    assert row.status == "completed" and row.started_at == T0 and row.ended_at == events[-1].ts
    m = row.metrics
    times = [e.step_time_s for e in events if isinstance(e, StepEvent)]
    assert m["steps"] == 300
    assert m["training_time_s"] == pytest.approx((events[-1].ts - T0).total_seconds())
    assert m["step_time_median_s"] == pytest.approx(statistics.median(times), rel=0.02)
    assert m["step_time_p95_s"] == pytest.approx(statistics.quantiles(times, n=20)[-1], rel=0.05)
    assert m["data_wait_share"] == pytest.approx(0.1)
    assert m["mfu"] == pytest.approx(0.4)
    assert m["max_cuda_allocated_bytes"] == 10**9 + 299 and m["max_cuda_peak_bytes"] == 10**9 + 598
    assert m["max_cuda_reserved_bytes"] == 2 * 10**9 and m["max_host_rss_bytes"] == 5 * 10**8
    assert [k for k in m if k.startswith("loss_at_step_")] == [
        "loss_at_step_0",
        "loss_at_step_100",
        "loss_at_step_200",
    ]
    assert m["loss_at_step_100"] == pytest.approx(2.0 - 100 / 300)
    assert m["final_loss"] == pytest.approx(statistics.median(2.0 - s / 300 for s in range(290, 300)))
    assert m["last_eval_loss"] == 1.3 and m["best_eval_loss"] == 1.2
    assert m["category_loss_speech"] == pytest.approx(1.299)
    assert m["anomalies_loss_spike"] == 1
    assert m["rollbacks"] == 1  # one applied rollback, acked by two ranks; the failed one is not


def test_a_run_that_died_says_so_and_ends_at_its_last_event():
    events = run_events(end=False)
    row = summarize(events).summary(status_if_not_ended="died")
    assert row.status == "died" and row.ended_at == events[-1].ts


def test_the_hardware_fingerprint_groups_comparable_runs():
    a, b = run_events("a")[0], run_events("b", seed=1)[0]
    other = run_events("c", gpus=("A100",))[0]
    assert hardware_fingerprint(a) == hardware_fingerprint(b) != hardware_fingerprint(other)
    assert (
        summarize(run_events("a")).summary().fingerprint
        == summarize(run_events("b", seed=1)).summary().fingerprint
    )
    declared = a.model_copy(update={"tags": {"hardware": "cpu-box-2"}})
    assert hardware_fingerprint(declared) == {"hardware": "cpu-box-2"}


def test_state_pickles_mid_run_and_resumes_with_the_same_summary():
    events = run_events()
    whole = summarize(events)
    first = RunSummarizer("r1")
    for e in events[:150]:
        first.observe(e)
    resumed = pickle.loads(pickle.dumps(first))
    for e in events[150:]:
        resumed.observe(e)
    assert resumed.summary() == whole.summary()


def test_a_slower_commit_stands_out_against_ten_summaries_of_its_job():
    history = [summarize(run_events(f"h{i}", seed=i)).summary().metrics for i in range(10)]
    slower = summarize(run_events("new", step_time=0.236, seed=99)).summary().metrics
    comparisons = compare_run(slower, history, BaselineConfig())
    flagged = {c.metric for c in outliers(comparisons)}
    assert "step_time_median_s" in flagged and "samples_per_s" in flagged  # slower, so fewer samples/s
    assert "final_loss" not in flagged and "max_cuda_peak_bytes" not in flagged
    same = summarize(run_events("same", seed=42)).summary().metrics
    assert outliers(compare_run(same, history, BaselineConfig())) == []


def test_loss_every_must_be_positive():
    with pytest.raises(ValueError):
        RunSummarizer("r", loss_every=0)


def _categories_changing(steps: int = 300, seed: int = 5) -> list[StepEvent]:
    """Steps whose categories come, go and change order (each category's last mean must survive)."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        cats = {f"c{i}": CategoryLoss(mean=1.0 + i + rng.gauss(0, 0.1), count=4) for i in range(4)}
        if 100 <= step < 200:
            del cats["c3"]  # gone for a while: its mean from step 99 stands until it is back
        if 140 <= step < 150:
            cats["extra"] = CategoryLoss(mean=9.0 + step, count=2)  # only these steps: its last is kept
        if step >= 250:
            cats = dict(reversed(list(cats.items())))
        out.append(StepEvent(run_id="r1", step=step, ts=T0 + timedelta(seconds=step), category_loss=cats))
    return out


def test_a_summarizer_pickled_before_it_kept_the_latest_categories_aside_carries_on():
    events = _categories_changing()
    whole = summarize(events).summary()
    for split in (120, 145, 260):
        first = summarize(events[:split])
        # As the code before pickled it: every step's means copied into _category, none waiting aside.
        state = dict(vars(first))
        latest = state.pop("_latest_categories")
        state["_category"] = {**state["_category"], **{n: c.mean for n, c in latest.items()}}
        as_before = RunSummarizer.__new__(RunSummarizer)
        as_before.__dict__.update(state)
        old = pickle.dumps(as_before)
        assert b"_latest_categories" not in old
        resumed = pickle.loads(old)
        assert resumed._latest_categories is None  # (the class default)
        assert resumed.summary() == first.summary()
        for e in events[split:]:
            resumed.observe(e)
        assert resumed.summary() == whole
    assert whole.metrics["category_loss_extra"] == 9.0 + 149
