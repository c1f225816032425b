"""The per-step baseline band (detectors/runwatch/detectors/baselines/band.py) and the in-flight detector that
compares a run with it (detectors/runwatch/detectors/baseline_trajectory.py), on seeded synthetic runs."""

from __future__ import annotations

import json
import math
import pickle
import random
import time
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from runwatch.contract.schema import EvalEvent, MemoryStats, StepEvent
from runwatch.detectors.baseline_trajectory import (
    BaselineTrajectoryConfig,
    BaselineTrajectoryDetector,
    hand_band,
)
from runwatch.detectors.baselines.band import (
    RunRecord,
    band_from_runs,
    bucket_steps_for,
    quantile,
    select_baseline_runs,
)
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
STEPS = 120
MODULES = ("embed", "block", "head")


def run(
    seed: int,
    *,
    run_id: str | None = None,
    module_boost: float = 1.0,
    loss_boost: float = 1.0,
    from_step: int = 0,
    slow: float = 1.0,
    val_boost: float = 1.0,
) -> list:
    """A healthy seeded run; the boosts multiply a metric from ``from_step`` on."""
    rng = random.Random(seed)
    rid = run_id or f"run-{seed}"
    events, t = [], T0 + timedelta(days=seed)
    for step in range(STEPS):
        t += timedelta(seconds=0.3)
        bad = step >= from_step
        noise = math.exp(rng.gauss(0, 0.1))
        modules = {
            m: (0.5 if m == "block" else 0.1) * math.exp(-step / 80) * math.exp(rng.gauss(0, 0.1))
            for m in MODULES
        }
        if bad:
            modules["embed"] *= module_boost
        events.append(
            StepEvent(
                run_id=rid,
                step=step,
                ts=t,
                loss=2.0 * math.exp(-step / 60) * noise * (loss_boost if bad else 1.0),
                grad_norm=math.sqrt(sum(v * v for v in modules.values())),
                module_grad_norms=modules,
                step_time_s=0.3 * math.exp(rng.gauss(0, 0.02)) * (slow if bad else 1.0),
                memory=MemoryStats(allocated=1000 + step, peak=1500, host_rss=5000),
            )
        )
        if step % 20 == 19:
            val = 1.5 * math.exp(-step / 80) * math.exp(rng.gauss(0, 0.03)) * (val_boost if bad else 1.0)
            events.append(EvalEvent(run_id=rid, step=step, ts=t, loss=val))
    return events


HISTORY = [run(seed) for seed in range(1, 6)]
BAND = band_from_runs(HISTORY, baseline_key="job", fingerprint="fp")


def detector(**overrides) -> BaselineTrajectoryDetector:
    d = BaselineTrajectoryDetector(BaselineTrajectoryConfig(**overrides))
    d.set_band(BAND)
    return d


def feed(d: BaselineTrajectoryDetector, events: list) -> list:
    return [f for e in events for f in d.update(e, e.ts)]


# -- the band --------------------------------------------------------------------------------------


def test_quantiles_interpolate_linearly_as_numpy_does():
    rng = random.Random(3)
    for n in (1, 2, 3, 7, 20):
        values = sorted(rng.random() for _ in range(n))
        for q in (0.1, 0.5, 0.9):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_the_band_holds_rank_zeros_quantiles_per_step_and_a_replayed_step_counts_once():
    band = BAND
    assert band.run_ids == [f"run-{s}" for s in range(1, 6)] and band.n_runs == 5
    expected = {
        "loss",
        "grad_norm",
        "step_time_s",
        "memory_allocated",
        "memory_peak",
        "memory_host_rss",
        "eval_loss/val",
        *(f"module_grad_norm/{m}" for m in MODULES),
    }
    assert set(band.metrics) == expected
    at7 = sorted(next(e.loss for e in r if isinstance(e, StepEvent) and e.step == 7) for r in HISTORY)
    loss = band.metrics["loss"]
    assert loss.steps == list(range(STEPS)) and loss.runs[7] == 5
    assert (loss.lo[7], loss.mid[7], loss.hi[7]) == pytest.approx(tuple(np.quantile(at7, (0.1, 0.5, 0.9))))
    assert band.metrics["eval_loss/val"].steps == list(range(19, STEPS, 20))
    # another rank's steps are not the run's; a step replayed after a rollback keeps its newest value
    extra = HISTORY[0] + [
        StepEvent(run_id="run-1", rank=1, step=7, ts=T0, loss=1e6),
        StepEvent(run_id="run-1", step=7, ts=T0 + timedelta(days=9), loss=1e6),
    ]
    again = band_from_runs([extra], baseline_key="job", fingerprint="fp").metrics["loss"]
    assert again.mid[7] == 1e6 and again.runs[7] == 1 and len(again.steps) == STEPS


def test_buckets_pool_their_steps_and_the_model_round_trips_as_json():
    assert bucket_steps_for(99, 2000) == 1 and bucket_steps_for(9_999, 2000) == 5
    band = band_from_runs(HISTORY, baseline_key="job", fingerprint="fp", bucket_steps=10)
    loss = band.metrics["loss"]
    assert loss.steps == list(range(0, STEPS, 10)) and loss.runs[0] == 5
    pooled = sorted(e.loss for r in HISTORY for e in r if isinstance(e, StepEvent) and e.step < 10)
    assert loss.mid[0] == pytest.approx(float(np.median(pooled)))
    assert type(band).model_validate(json.loads(band.model_dump_json())) == band


def record(run_id: str, day: float, **kw) -> RunRecord:
    fields = {"baseline_key": "job", "fingerprint": "fp", "status": "completed", "new_baseline": False, **kw}
    return RunRecord(run_id=run_id, started_at=T0 + timedelta(days=day), **fields)


def test_the_history_is_the_same_job_and_hardware_completed_before_it_in_the_window_since_a_new_baseline():
    me = record("me", 40)
    candidates = [
        record("old", 5),
        record("a", 20),
        record("b", 30),
        record("failed", 31, status="failed"),
        record("other-job", 32, baseline_key="x"),
        record("other-hw", 33, fingerprint="y"),
        record("later", 41),
        record("c", 39),
        me,
    ]
    chosen = select_baseline_runs(me, candidates, window_days=30, max_runs=20)
    assert [r.run_id for r in chosen] == ["a", "b", "c"]  # "old" is outside the 30 days
    assert [r.run_id for r in select_baseline_runs(me, candidates, window_days=30, max_runs=2)] == ["b", "c"]
    declared = candidates + [record("new", 25, new_baseline=True)]
    assert [r.run_id for r in select_baseline_runs(me, declared, window_days=30, max_runs=20)] == [
        "new",
        "b",
        "c",
    ]
    assert (
        select_baseline_runs(record("me", 40, new_baseline=True), candidates, window_days=30, max_runs=20)
        == []
    )


# -- the detector ----------------------------------------------------------------------------------


def test_a_healthy_run_of_the_job_raises_nothing():
    assert feed(detector(), run(11)) == []


def test_without_a_band_it_is_silent_and_when_told_why_it_says_so_once_as_info():
    d = BaselineTrajectoryDetector(BaselineTrajectoryConfig())
    bad = run(12, module_boost=50)
    assert feed(d, bad) == []  # nothing handed in: no source of history configured
    d.set_band(None, "no earlier completed run")
    said = feed(d, bad)
    assert [(f.severity, f.metric, f.message) for f in said] == [
        ("info", "baseline_band", "no earlier completed run")
    ]
    few = BaselineTrajectoryDetector(BaselineTrajectoryConfig(min_runs=6))
    few.set_band(BAND)  # 5 runs
    said = feed(few, bad)
    assert len(said) == 1 and said[0].severity == "info" and "fewer than min_runs 6" in said[0].message


def test_a_module_far_above_where_it_sat_is_named_after_k_steps_with_the_band_in_the_evidence():
    d = detector(consecutive_steps=10)
    found = feed(d, run(13, module_boost=30, from_step=40))
    assert {f.metric for f in found} == {"module_grad_norm/embed", "grad_norm"}  # the global norm follows it
    found = [f for f in found if f.evidence["family"] == "module"]
    assert [(f.step, f.evidence["module"]) for f in found] == [(49, "embed")]
    f = found[0]
    assert f.metric == "module_grad_norm/embed" and f.evidence["onset_step"] == 40
    assert (
        f.value > f.threshold >= 5 * f.evidence["band_hi"] > f.evidence["band_median"] > f.evidence["band_lo"]
    )
    assert f.evidence["baseline_runs"] == 5 and f.evidence["ratio_to_median"] > 10


def test_the_module_with_the_largest_departure_is_the_one_named():
    events = run(14, module_boost=20)
    for e in events:  # the head goes up too, but less
        if isinstance(e, StepEvent):
            e.module_grad_norms["head"] *= 8
    found = [f for f in feed(detector(), events) if f.evidence["family"] == "module"]
    assert found[0].evidence["module"] == "embed" and "head" in found[0].evidence["also_above"]
    assert found[0].score > 2 * found[0].evidence["also_above"]["head"]


def test_later_divergence_slower_steps_and_earlier_overfitting_are_found_and_noise_is_not():
    found = feed(detector(), run(15, loss_boost=3, from_step=60))
    assert [(f.metric, f.step) for f in found] == [("loss", 69)]
    found = feed(detector(), run(16, slow=1.5, from_step=30))
    assert [f.metric for f in found] == ["step_time_s"]
    found = feed(detector(), run(17, val_boost=2, from_step=50))
    assert [(f.metric, f.step) for f in found] == [("eval_loss/val", 79)]
    assert feed(detector(), run(18, loss_boost=1.2, slow=1.1)) == []  # within the tolerances


def test_an_episode_gives_one_finding_and_the_metric_re_arms_once_back_inside():
    events = run(19, loss_boost=3, from_step=30)
    for e in events:
        if isinstance(e, StepEvent) and 60 <= e.step < 70:
            e.loss /= 3  # back inside for a while
    assert [f.step for f in feed(detector(), events) if f.metric == "loss"] == [39, 79]


def test_state_pickles_with_its_band_and_resumes_with_the_same_findings():
    events = run(20, module_boost=30, loss_boost=3, from_step=40)
    whole = feed(detector(), events)
    first = detector()
    before = feed(first, events[:60])
    resumed = pickle.loads(pickle.dumps(first))
    assert before + feed(resumed, events[60:]) == whole and whole


def test_the_monitor_takes_the_band_handed_to_its_detector():
    monitor = RunMonitor("run-21", RunwatchConfig())
    assert hand_band(monitor.joined_detectors, BAND)
    found = [
        a
        for e in run(21, module_boost=30, from_step=40)
        for a in monitor.observe(e).anomalies
        if a.detector == "baseline_trajectory" and a.evidence["family"] == "module"
    ]
    assert [(a.step, a.evidence["module"]) for a in found] == [(49, "embed")]


def test_cost_per_step_event_is_small():
    """Printed, not asserted as a time (benchmarks compare ratios): the cost of one step event."""
    d = detector()
    events = [e for e in run(22) if isinstance(e, StepEvent)]
    started = time.perf_counter()
    for _ in range(20):
        for e in events:
            d.update(e, e.ts)
    per_event_us = (time.perf_counter() - started) / (20 * len(events)) * 1e6
    print(
        json.dumps(
            {
                "baseline_trajectory_us_per_step_event": round(per_event_us, 2),
                "metrics_per_event": 6 + len(MODULES),
            }
        )
    )
    assert per_event_us < 1000  # a sanity bound only


def test_rewind_snapshots_refer_to_the_band_instead_of_copying_it():
    """A checkpoint's snapshot of the detectors holds the band by reference: a band of many modules
    and steps is not copied at every checkpoint, and a rewound detector still has it."""
    from runwatch.detectors.engine.rewind import DetectorSnapshots

    monitor = RunMonitor("r", RunwatchConfig())
    hand_band(monitor.joined_detectors, BAND, None)
    with_band = DetectorSnapshots()
    with_band.take(10, monitor._rewindable())
    bare = RunMonitor("r", RunwatchConfig())
    without = DetectorSnapshots()
    without.take(10, bare._rewindable())
    assert len(pickle.dumps(BAND)) > 20_000
    assert with_band.nbytes - without.nbytes < 1_000
    live = next(d for d in monitor.joined_detectors if isinstance(d, BaselineTrajectoryDetector))
    restored = with_band.restore(10)
    trajectory = next(d for d in restored["joined"] if isinstance(d, BaselineTrajectoryDetector))
    assert trajectory is not live and trajectory._band is live._band  # the same table, not a copy
    assert feed(trajectory, run(9, module_boost=50.0, from_step=30))  # and it still judges
