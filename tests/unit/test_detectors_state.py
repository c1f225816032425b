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

from runwatch.detectors.config import MemoryConfig
from runwatch.detectors.findings import Finding
from runwatch.detectors.memory_growth import MemoryGrowthDetector
from runwatch.producer.schema import MemoryStats, StepEvent

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
        return {"allocated": int(a), "reserved": int(a + f), "peak": int(a + f), "device_total": 80 * GiB,
                "host_rss": int(3 * GiB + rng.gauss(0, 5 * MiB)), "cgroup_usage": 5 * GiB, "cgroup_limit": 64 * GiB}

    return shape


def memory_events(shape: MemoryShape, steps: int = 1000, seed: int = 0, interval_s: float = 1.0) -> list[StepEvent]:
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
    "allocator warm-up ramp over the first 60 steps": gpu(lambda s: 10 * GiB * min(1.0, (s + 1) / 60),
                                                          fragment=lambda s: 2 * GiB * min(1.0, (s + 1) / 80)),
    "sawtooth: eval buffers freed every 40 steps": gpu(lambda s: 10 * GiB + (s % 40) * 20 * MiB),
    "eval bump of 2 GiB for 10 steps every 100": gpu(lambda s: 10 * GiB + (2 * GiB if s % 100 < 10 else 0)),
    "one-time step up after the first eval": gpu(lambda s: 10 * GiB + (3 * GiB if s >= 300 else 0),
                                                 fragment=lambda s: 2 * GiB + (GiB if s >= 300 else 0)),
    "cpu-only, noisy": lambda s, rng: {"host_rss": int(2 * GiB + rng.gauss(0, 50 * MiB))},
    "slow growth: insignificant and the limit is far": gpu(lambda s: 10 * GiB + s * 0.5 * MiB),
}


@pytest.mark.parametrize("name", BENIGN_MEMORY)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_benign_memory_patterns_do_not_fire(name, seed):
    found = feed(MemoryGrowthDetector(MemoryConfig()), memory_events(BENIGN_MEMORY[name], steps=1500, seed=seed))
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
