"""The stateful detectors: memory growth (leak vs fragmentation, time to the limit), one data
category's loss diverging, validation worsening while training improves, and a stalled or silent
rank. Each must fire on its fault with the right kind (or category) soon after the onset, stay
silent on the benign look-alikes a real run produces, and continue identically after a pickle
round trip mid-stream (the worker snapshots its state)."""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import CategoryLoss, EvalEvent, HeartbeatEvent, MemoryStats, StepEvent
from runwatch.detectors.category import CategoryDivergenceDetector
from runwatch.detectors.config import CategoryConfig, GeneralizationConfig, MemoryConfig, StallConfig
from runwatch.detectors.findings import Finding
from runwatch.detectors.generalization import ValVsTrainDetector
from runwatch.detectors.memory_growth import MemoryGrowthDetector
from runwatch.detectors.stall import StallDetector

T0 = datetime(2026, 11, 21, 9, 0, tzinfo=UTC)
GiB = 1 << 30
MiB = 1 << 20


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def feed(detector, events) -> list[Finding]:
    found: list[Finding] = []
    for event in events:
        found += detector.update(event, event.ts)
    return found


def assert_pickles_mid_stream(make, events, split: int) -> None:
    """Same findings with and without a pickle round trip after ``split`` events."""
    straight = feed(make(), events)
    first = make()
    before = feed(first, events[:split])
    restored = pickle.loads(pickle.dumps(first))
    assert before + feed(restored, events[split:]) == straight


# -- memory growth --------------------------------------------------------------------------------

MemoryShape = Callable[[int, random.Random], dict]


def gpu(allocated: float, fragment: float = 2 * GiB, noise: float = 30 * MiB) -> MemoryShape:
    """A CUDA rank: ``allocated(step)`` and the cached-but-free ``fragment(step)`` on an 80 GiB device,
    a 64 GiB cgroup on the host. Both arguments may be callables of the step."""

    def shape(step: int, rng: random.Random) -> dict:
        a = (allocated(step) if callable(allocated) else allocated) + rng.gauss(0, noise)
        f = fragment(step) if callable(fragment) else fragment
        return {
            "allocated": int(a),
            "reserved": int(a + f),
            "peak": int(a + f),
            "device_total": 80 * GiB,
            "host_rss": int(3 * GiB + rng.gauss(0, 5 * MiB)),
            "cgroup_usage": 5 * GiB,
            "cgroup_limit": 64 * GiB,
        }

    return shape


def memory_events(
    shape: MemoryShape, steps: int = 1000, seed: int = 0, interval_s: float = 1.0
) -> list[StepEvent]:
    rng = random.Random(seed)
    return [
        StepEvent(run_id="r", step=i, ts=at(i * interval_s), memory=MemoryStats(**shape(i, rng)))
        for i in range(steps)
    ]


def after(onset: int, per_step: float) -> Callable[[int], float]:
    return lambda step: max(0, step - onset) * per_step


def test_allocated_growing_steadily_is_a_leak_with_time_to_the_device_limit():
    leak = after(200, 20 * MiB)  # 20 MiB/s on a 1 s step
    events = memory_events(gpu(lambda s: 10 * GiB + leak(s)), steps=3600)
    found = feed(MemoryGrowthDetector(MemoryConfig()), events)
    assert found and {f.metric for f in found} == {"allocated"}
    first = found[0]
    assert first.detector == "memory_growth" and first.evidence["kind"] == "leak"
    assert 200 < first.step <= 300  # within one window of the onset
    assert first.severity == "warning"
    assert first.evidence["onset_step"] < first.step
    # Projection from the slope per second: (80 GiB - reserved) at 20 MiB/s.
    reserved = events[first.step].memory.reserved
    expected = (80 * GiB - reserved) / (20 * MiB)
    assert first.evidence["seconds_to_limit"] == pytest.approx(expected, rel=0.15)
    assert "leak" in first.message and "limit" in first.message
    # As the limit comes within the critical horizon the finding escalates, at about 600 s before it.
    critical = [f for f in found if f.severity == "critical"]
    assert critical
    remaining = (80 * GiB - events[critical[0].step].memory.reserved) / (20 * MiB)
    assert 450 < remaining <= 650
    assert critical[0].evidence["seconds_to_limit"] <= 600


def test_reserved_growing_over_flat_allocated_is_fragmentation_not_a_leak():
    events = memory_events(gpu(10 * GiB, fragment=lambda s: 2 * GiB + after(200, 20 * MiB)(s)), steps=1000)
    found = feed(MemoryGrowthDetector(MemoryConfig()), events)
    assert found and {f.evidence["kind"] for f in found} == {"fragmentation"}
    assert found[0].metric == "fragmentation" and 200 < found[0].step <= 300
    assert found[0].evidence["seconds_to_limit"] is not None


def test_a_leak_that_also_grows_reserved_is_reported_once_as_a_leak():
    leak = after(200, 20 * MiB)
    events = memory_events(gpu(lambda s: 10 * GiB + leak(s), fragment=lambda s: 2 * GiB + leak(s) / 2))
    found = feed(MemoryGrowthDetector(MemoryConfig()), events)
    assert found and {(f.metric, f.evidence["kind"]) for f in found} == {("allocated", "leak")}


def test_cpu_only_run_leaks_through_host_rss_even_without_a_limit():
    def shape(step, rng):
        return {"host_rss": int(2 * GiB + after(200, 10 * MiB)(step) + rng.gauss(0, 5 * MiB))}

    found = feed(MemoryGrowthDetector(MemoryConfig()), memory_events(shape))
    assert found and found[0].metric == "host_rss" and found[0].evidence["kind"] == "leak"
    assert found[0].severity == "warning" and found[0].evidence["seconds_to_limit"] is None
    assert "no memory limit" in found[0].message


def test_host_leak_projects_to_the_cgroup_limit():
    def shape(step, rng):
        rss = 2 * GiB + after(200, 10 * MiB)(step) + rng.gauss(0, 5 * MiB)
        return {"host_rss": int(rss), "cgroup_usage": int(rss + GiB), "cgroup_limit": 8 * GiB}

    found = feed(MemoryGrowthDetector(MemoryConfig()), memory_events(shape))
    assert found[0].metric == "host_rss" and found[0].threshold == 8 * GiB
    assert found[0].evidence["seconds_to_limit"] < 3600
    assert any(f.severity == "critical" for f in found)


BENIGN_MEMORY = {
    "flat with batch-shape noise": gpu(10 * GiB, noise=200 * MiB),
    "allocator warm-up ramp over the first 60 steps": gpu(
        lambda s: 10 * GiB * min(1.0, (s + 1) / 60), fragment=lambda s: 2 * GiB * min(1.0, (s + 1) / 80)
    ),
    "sawtooth: eval buffers freed every 40 steps": gpu(lambda s: 10 * GiB + (s % 40) * 20 * MiB),
    "eval bump of 2 GiB for 10 steps every 100": gpu(lambda s: 10 * GiB + (2 * GiB if s % 100 < 10 else 0)),
    "one-time step up after the first eval": gpu(
        lambda s: 10 * GiB + (3 * GiB if s >= 300 else 0),
        fragment=lambda s: 2 * GiB + (GiB if s >= 300 else 0),
    ),
    "cpu-only, noisy": lambda s, rng: {"host_rss": int(2 * GiB + rng.gauss(0, 50 * MiB))},
    "slow growth: insignificant and the limit is far": gpu(lambda s: 10 * GiB + s * 0.5 * MiB),
}


@pytest.mark.parametrize("name", BENIGN_MEMORY)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_benign_memory_patterns_do_not_fire(name, seed):
    found = feed(
        MemoryGrowthDetector(MemoryConfig()), memory_events(BENIGN_MEMORY[name], steps=1500, seed=seed)
    )
    assert found == [], [f.message for f in found]


def test_a_long_sawtooth_is_not_a_leak_once_it_has_dropped_back():
    # Its first rise (150 steps, longer than the window) is a leak as far as anyone can tell; after the
    # first drop each rise only returns to the old peak, which a leak would have to exceed.
    events = memory_events(gpu(lambda s: 10 * GiB + (s % 150) * 20 * MiB), steps=1500)
    found = feed(MemoryGrowthDetector(MemoryConfig()), events)
    assert [f for f in found if f.step >= 150] == []


def test_memory_detector_ignores_events_without_memory_and_replayed_steps():
    det = MemoryGrowthDetector(MemoryConfig())
    events = memory_events(gpu(lambda s: 10 * GiB + after(0, 20 * MiB)(s)), steps=150)
    for event in events[:120]:
        det.update(event, event.ts)
    assert det.update(StepEvent(run_id="r", step=120, ts=at(120)), at(120)) == []
    # a rollback replays steps 50.. with lower memory: those do not fold the fit back on itself
    replay = memory_events(gpu(10 * GiB), steps=120)[50:]
    assert feed(det, replay) == []


def test_memory_detector_pickles_mid_stream():
    events = memory_events(gpu(lambda s: 10 * GiB + after(200, 20 * MiB)(s)), steps=1200)
    assert_pickles_mid_stream(lambda: MemoryGrowthDetector(MemoryConfig()), events, split=250)


def test_memory_config_rejects_min_points_beyond_the_window():
    with pytest.raises(ValueError, match="min_points"):
        MemoryConfig(window=50, min_points=60)
    assert math.isfinite(MemoryConfig().warn_horizon_s)


# -- category divergence --------------------------------------------------------------------------

# Typical losses differ a lot ("legal" is always the hardest), and so do the shares of the batch.
CATEGORY_BASE = {
    "web": 1.0,
    "code": 0.8,
    "math": 1.5,
    "books": 1.1,
    "wiki": 0.9,
    "chat": 1.2,
    "legal": 3.0,
    "news": 1.05,
}
CATEGORY_WEIGHT = {"web": 4, "code": 2, "math": 1, "books": 1, "wiki": 1, "chat": 1, "legal": 0.5, "news": 1}


def category_events(steps: int = 800, batch: int = 256, seed: int = 0, fault=None) -> list[StepEvent]:
    """A decreasing training curve; each category's per-step mean is that of its ``count`` samples
    (per-sample coefficient of variation 0.7), so small counts are noisy. ``fault(name, step)``
    multiplies a category's loss."""
    rng = random.Random(seed)
    names = list(CATEGORY_BASE)
    weights = [CATEGORY_WEIGHT[n] for n in names]
    events = []
    for step in range(steps):
        counts = dict.fromkeys(names, 0)
        for name in rng.choices(names, weights=weights, k=batch):
            counts[name] += 1
        curve = 0.6 + 0.4 * math.exp(-step / 300)
        losses = {}
        for name, count in counts.items():
            if count:
                factor = fault(name, step) if fault else 1.0
                mean = CATEGORY_BASE[name] * curve * factor * math.exp(rng.gauss(0, 0.7 / math.sqrt(count)))
                losses[name] = CategoryLoss(mean=mean, count=count)
        loss = sum(c.mean * c.count for c in losses.values()) / batch
        events.append(StepEvent(run_id="r", step=step, ts=at(step), loss=loss, category_loss=losses))
    return events


def gradual(category: str, onset: int, to: float = 3.0, over: int = 30):
    return lambda name, step: (
        1 + (to - 1) * min(1.0, max(0.0, (step - onset) / over)) if name == category else 1.0
    )


def sudden(category: str, onset: int, to: float = 3.0):
    return lambda name, step: to if name == category and step >= onset else 1.0


@pytest.mark.parametrize("category", ["math", "legal", "code"])
@pytest.mark.parametrize("shape", [gradual, sudden])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_diverging_category_is_named_while_the_mean_looks_fine(category, shape, seed):
    found = feed(
        CategoryDivergenceDetector(CategoryConfig()), category_events(seed=seed, fault=shape(category, 400))
    )
    assert found, "no finding"
    first = found[0]
    assert {f.evidence["category"] for f in found} == {category}
    assert first.detector == "category_divergence" and first.metric == f"category_loss.{category}"
    assert 400 < first.step <= 400 + (45 if shape is gradual else 15)
    assert 400 <= first.evidence["onset_step"] < first.step
    assert first.evidence["ratio"] >= 1.5
    assert first.evidence["mean_loss_ratio"] < 1.5  # the run's mean barely moved: one of 8 categories
    assert first.evidence["others_median_ratio"] < 1.25
    assert repr(category) in first.message


def test_a_category_sampled_a_few_times_per_step_is_pooled_and_still_caught():
    found = feed(
        CategoryDivergenceDetector(CategoryConfig()), category_events(batch=16, fault=sudden("code", 400))
    )
    assert found and found[0].evidence["category"] == "code"
    assert 400 < found[0].step <= 460


@pytest.mark.parametrize("batch", [256, 16, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_categories_do_not_fire_even_with_small_noisy_counts(batch, seed):
    found = feed(
        CategoryDivergenceDetector(CategoryConfig()), category_events(steps=1000, batch=batch, seed=seed)
    )
    assert found == [], [f.message for f in found]


@pytest.mark.parametrize("batch", [256, 16])
def test_all_categories_rising_together_is_not_a_category_divergence(batch):
    def everything(name, step):
        return 1 + 2 * min(1.0, max(0.0, (step - 400) / 30))

    assert (
        feed(CategoryDivergenceDetector(CategoryConfig()), category_events(batch=batch, fault=everything))
        == []
    )


def test_category_detector_pickles_mid_stream():
    events = category_events(steps=600, fault=gradual("math", 400))
    assert_pickles_mid_stream(lambda: CategoryDivergenceDetector(CategoryConfig()), events, split=410)


# -- validation vs train --------------------------------------------------------------------------


def train_curve(step: int) -> float:
    return 1 + 2 * math.exp(-step / 2000)


def val_curve(step: int) -> float:
    return 1.2 + 2 * math.exp(-step / 2000)


def overfit_after(onset: int, per_1000_steps: float = 0.1):
    return lambda s: (
        val_curve(s) if s < onset else val_curve(onset) * (1 + per_1000_steps * (s - onset) / 1000)
    )


def eval_events(
    train=train_curve,
    val=val_curve,
    steps: int = 6000,
    every: int = 200,
    seed: int = 0,
    train_noise: float = 0.05,
    val_noise: float = 0.01,
) -> list:
    rng = random.Random(seed)
    events = []
    for step in range(steps):
        events.append(
            StepEvent(
                run_id="r", step=step, ts=at(step), loss=train(step) * math.exp(rng.gauss(0, train_noise))
            )
        )
        if step and step % every == 0:
            loss = val(step) * math.exp(rng.gauss(0, val_noise))
            events.append(EvalEvent(run_id="r", step=step, ts=at(step + 0.5), split="val", loss=loss))
    return events


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("val_noise", [0.01, 0.03])
def test_val_worsening_while_train_improves_fires_once_with_its_best(seed, val_noise):
    events = eval_events(
        val=overfit_after(3000, 0.1 if val_noise < 0.02 else 0.2), seed=seed, val_noise=val_noise
    )
    found = feed(ValVsTrainDetector(GeneralizationConfig()), events)
    assert len(found) == 1  # once per episode, not at every later eval
    f = found[0]
    assert f.detector == "val_vs_train" and f.metric == "eval_loss.val" and f.severity == "warning"
    assert 2600 <= f.evidence["best_step"] <= 3200
    assert f.evidence["best_step"] < f.step <= 5000  # within 10 evals of the turn
    assert f.evidence["best_val"] < f.value
    assert f.evidence["train_trend"] < 0  # the train loss improved since the best eval
    assert f.evidence["onset_step"] == f.evidence["best_step"] + 1
    assert f.evidence["consecutive_evals"] >= 2
    assert "above its best" in f.message


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("val_noise", [0.01, 0.04, 0.08])
def test_noisy_val_that_improves_overall_does_not_fire(seed, val_noise):
    assert feed(ValVsTrainDetector(GeneralizationConfig()), eval_events(seed=seed, val_noise=val_noise)) == []


@pytest.mark.parametrize("seed", range(6))
def test_val_and_train_worsening_together_is_not_this_detectors_finding(seed):
    def worse(curve):
        return lambda s: curve(s) if s < 3000 else curve(3000) * (1 + 0.2 * (s - 3000) / 1000)

    events = eval_events(train=worse(train_curve), val=worse(val_curve), seed=seed)
    assert feed(ValVsTrainDetector(GeneralizationConfig()), events) == []


def test_a_new_best_rearms_the_detector_and_other_splits_are_separate():
    det = ValVsTrainDetector(GeneralizationConfig())
    events = eval_events(val=overfit_after(3000), steps=5000)
    found = feed(det, events)
    assert len(found) == 1
    # a new best on "val" re-arms; a "test" split of its own has no history yet
    assert det.update(EvalEvent(run_id="r", step=5000, ts=at(5000), split="val", loss=0.5), at(5000)) == []
    assert det.update(EvalEvent(run_id="r", step=5000, ts=at(5000), split="test", loss=9.0), at(5000)) == []


def test_val_vs_train_pickles_mid_stream():
    events = eval_events(val=overfit_after(3000))
    split = next(i for i, e in enumerate(events) if isinstance(e, EvalEvent) and e.step == 3400)
    assert_pickles_mid_stream(lambda: ValVsTrainDetector(GeneralizationConfig()), events, split=split)


# -- stall ----------------------------------------------------------------------------------------


def training_timeline(
    steps: int = 1500,
    step_s: float = 2.0,
    seed: int = 0,
    stop_after: int | None = None,
    heartbeats_after_stop: bool = True,
    eval_every: int = 500,
    eval_s: float = 240.0,
    ckpt_every: int = 1000,
    ckpt_s: float = 600.0,
    end_s: float | None = None,
    heartbeat_s: float = 10.0,
    declare_interval: bool = False,
):
    """(time, event or None) in time order: steps with jittered durations, a heartbeat every
    ``heartbeat_s`` reporting the phase (and its period, if ``declare_interval``), evals and checkpoint saves
    that pause the steps, and a tick every second (None). ``stop_after``: no step completes after this one
    (heartbeats go on, or not)."""
    rng = random.Random(seed)
    items: list[tuple[float, object]] = []
    phases: list[tuple[float, float, str]] = []  # (start, end, phase) of the pauses
    t = 0.0
    for step in range(steps):
        t += step_s * math.exp(rng.gauss(0, 0.2))
        if stop_after is not None and step > stop_after:
            break
        items.append((t, StepEvent(run_id="r", step=step, ts=at(t), loss=1.0)))
        for every, length, phase in ((eval_every, eval_s, "eval"), (ckpt_every, ckpt_s, "checkpoint")):
            if step and step % every == 0:
                phases.append((t, t + length, phase))
                t += length
    last_step_t = t
    end = end_s if end_s is not None else t + 1
    stepped = [(ts, e.step) for ts, e in items]
    hb_end = end if heartbeats_after_stop else last_step_t
    beat, done = heartbeat_s / 2, 0
    while beat < hb_end:
        while done < len(stepped) and stepped[done][0] <= beat:
            done += 1
        phase = next((p for start, stop, p in phases if start <= beat < stop), "train")
        last = stepped[done - 1][1] if done else None
        items.append(
            (
                beat,
                HeartbeatEvent(
                    run_id="r",
                    ts=at(beat),
                    step=last,
                    phase=phase,
                    interval_s=heartbeat_s if declare_interval else None,
                ),
            )
        )
        beat += heartbeat_s
    items += [(float(s), None) for s in range(1, int(end))]
    items.sort(key=lambda item: (item[0], item[1] is None))
    return items


def drive(detector, items) -> list[Finding]:
    found: list[Finding] = []
    for t, event in items:
        found += detector.tick(at(t)) if event is None else detector.update(event, event.ts)
    return found


def found_at(finding: Finding, items) -> float:
    """When (seconds) a finding came out, by replaying until it appears."""
    det = StallDetector(StallConfig())
    for t, event in items:
        out = det.tick(at(t)) if event is None else det.update(event, event.ts)
        if finding in out:
            return t
    raise AssertionError("finding not reproduced")


@pytest.mark.parametrize("seed", range(3))
def test_healthy_run_with_long_evals_and_checkpoint_saves_is_not_a_stall(seed):
    assert drive(StallDetector(StallConfig()), training_timeline(seed=seed)) == []


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heartbeat_s", [1.0, 10.0])
def test_steps_stopping_while_heartbeats_go_on_is_a_stall_found_within_three_step_intervals(
    seed, heartbeat_s
):
    items = training_timeline(seed=seed, steps=900, stop_after=700, end_s=3000, heartbeat_s=heartbeat_s)
    found = drive(StallDetector(StallConfig()), items)
    assert len(found) == 1  # once per episode
    f = found[0]
    assert f.detector == "stall" and f.evidence["kind"] == "stalled" and f.evidence["phase"] == "train"
    assert f.step == 700 and f.severity == "warning"
    median = f.evidence["median_step_interval_s"]
    assert 1.5 < median < 2.5
    assert f.evidence["allowed_s"] == pytest.approx(3 * median + 10.0)  # + the train phase's allowance
    last_progress = max(t for t, e in items if isinstance(e, StepEvent))
    delay = found_at(f, items) - last_progress
    # 3 median steps + the train allowance (which outlasts a heartbeat period), + the tick period
    assert f.evidence["allowed_s"] < delay <= max(3 * median + 10.0, heartbeat_s) + 1
    assert f.evidence["seconds_since_progress"] > f.evidence["allowed_s"]


def test_a_checkpoint_save_that_hangs_is_a_stall_after_its_phase_allowance():
    # the save at step 1000 never returns
    items = training_timeline(steps=1001, ckpt_s=5000, eval_every=10**6)
    found = drive(StallDetector(StallConfig()), items)
    assert len(found) == 1 and found[0].evidence["phase"] == "checkpoint"
    assert found[0].step == 1000
    assert 900 < found[0].evidence["seconds_since_progress"] <= 900 + 3 * 2.5 + 12  # + a heartbeat period


def test_heartbeats_stopping_is_silence_not_a_stall():
    items = training_timeline(steps=900, stop_after=700, heartbeats_after_stop=False, end_s=2000)
    found = drive(StallDetector(StallConfig()), items)
    assert [f.evidence["kind"] for f in found] == ["silent"]
    assert found[0].severity == "critical" and found[0].step == 700
    assert 30 < found[0].evidence["seconds_since_heard"] <= 32  # heartbeat_timeout_s, the floor


def test_the_silence_timeout_follows_the_producers_heartbeat_period():
    # A 10-minute eval: no steps, only heartbeats, which this producer sends every 40 s.
    slow_beats = dict(steps=900, heartbeat_s=40.0, eval_every=500, eval_s=600.0)
    undeclared = drive(StallDetector(StallConfig()), training_timeline(**slow_beats))
    # the 30 s floor
    assert [f.evidence["kind"] for f in undeclared] == ["silent"] * len(undeclared) and undeclared
    # Declared in the heartbeats (interval_s), the period sets the timeout: 6 x 40 s, no false alarm.
    assert drive(StallDetector(StallConfig()), training_timeline(**slow_beats, declare_interval=True)) == []
    dead = training_timeline(
        steps=900,
        heartbeat_s=40.0,
        declare_interval=True,
        stop_after=700,
        heartbeats_after_stop=False,
        end_s=3000,
    )
    found = drive(StallDetector(StallConfig()), dead)
    assert [f.evidence["kind"] for f in found] == ["silent"]
    assert found[0].evidence["silent_after_s"] == 240.0
    assert 240 < found[0].evidence["seconds_since_heard"] <= 242


def test_a_stall_rearms_when_the_step_moves_and_a_rollback_is_movement():
    det = StallDetector(StallConfig())
    items = training_timeline(steps=300, eval_every=10**6, ckpt_every=10**6)
    assert drive(det, items) == []
    t = items[-1][0]
    assert det.tick(at(t + 30)) == []  # no heartbeat since the last step: the phase of the pause is unknown
    # the next heartbeat (train, still step 299) settles it: update checks on heartbeats too
    stalled = det.update(HeartbeatEvent(run_id="r", ts=at(t + 31), step=299), at(t + 31))
    assert [f.evidence["kind"] for f in stalled] == ["stalled"]
    assert det.tick(at(t + 40)) == []  # once per episode
    det.update(StepEvent(run_id="r", step=120, ts=at(t + 41)), at(t + 41))  # rolled back: movement
    assert det.progress.rank(0).step == 120
    assert det.tick(at(t + 42)) == []
    assert det.update(HeartbeatEvent(run_id="r", ts=at(t + 44), step=120), at(t + 44)) == []
    assert [f.evidence["kind"] for f in det.tick(at(t + 60))] == ["stalled"]  # 3 x ~2 s + 10 s after step 120


def test_no_stall_before_the_pace_is_known():
    det = StallDetector(StallConfig(min_steps=10))
    for step in range(5):
        det.update(StepEvent(run_id="r", step=step, ts=at(step)), at(step))
    det.update(HeartbeatEvent(run_id="r", ts=at(30), step=4), at(30))
    assert det.tick(at(50)) == []  # a compile or warm-up of unknown length


def test_stall_detector_pickles_mid_stream():
    items = training_timeline(steps=900, stop_after=700, end_s=3000)
    straight = drive(StallDetector(StallConfig()), items)
    split = len(items) // 2
    first = StallDetector(StallConfig())
    before = drive(first, items[:split])
    assert before + drive(pickle.loads(pickle.dumps(first)), items[split:]) == straight
    assert straight


def test_a_category_divergence_replayed_after_a_rollback_is_found_again():
    # A rollback sends the steps back: the cooldown after a finding does not cover the replayed steps.
    events = category_events(steps=440, fault=sudden("code", 400))
    det = CategoryDivergenceDetector(CategoryConfig())
    first = [f.step for f in feed(det, events)]
    assert first and 400 <= first[0] < 410
    replay = [f.step for f in feed(det, events[390:])]  # rolled back to step 390
    assert replay[:1] == first[:1]
