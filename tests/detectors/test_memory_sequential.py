"""memory_growth's sequential test (issue 27): growth found as soon as it is clear, dated from where it
began; one jump, a ramp that levels off and host RSS that swings around evals and checkpoints and comes
back are not growth; a snapshot taken before the test existed still loads. Every series is seeded."""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
import random
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import MemoryStats, StepEvent
from runwatch.detectors.findings import Finding
from runwatch.detectors.memory_growth import MemoryConfig, MemoryGrowthDetector, _Series
from runwatch.producer.instrument.memory import MemorySampler
from runwatch.scenarios.memory import HostSwings

T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

Shape = Callable[[int, random.Random], dict]


def events(shape: Shape, steps: int, seed: int = 0, interval_s: float = 0.25) -> list[StepEvent]:
    rng = random.Random(seed)
    return [
        StepEvent(
            run_id="r", step=i, ts=T0 + timedelta(seconds=i * interval_s), memory=MemoryStats(**shape(i, rng))
        )
        for i in range(steps)
    ]


def feed(detector: MemoryGrowthDetector, stream: list[StepEvent]) -> list[Finding]:
    found: list[Finding] = []
    for event in stream:
        found += detector.update(event, event.ts)
    return found


def allocator(
    allocated: Callable[[int], float], free: Callable[[int], float] = lambda _s: 128 * KiB
) -> Shape:
    """The corpus's CPU runs: the caching-allocator model (exact bytes: flat unless something changes)
    and a host RSS that creeps by a page now and then."""

    def shape(step: int, rng: random.Random) -> dict:
        a = int(allocated(step))
        return {
            "allocated": a,
            "reserved": a + int(free(step)),
            "host_rss": 430 * MiB + (step // 37) * 4 * KiB,
        }

    return shape


def from_step(onset: int, per_step: float) -> Callable[[int], float]:
    return lambda step: max(0, step - onset + 1) * per_step


def test_a_leak_is_found_once_it_has_lasted_min_steps_and_dated_from_its_first_step():
    # memory_leak_mlp's shape: 108 KiB retained every step from step 160 on a 362 KiB allocation.
    stream = events(allocator(lambda s: 362 * KiB + from_step(160, 108 * KiB)(s)), 400)
    found = feed(MemoryGrowthDetector(MemoryConfig()), stream)
    first = found[0]
    assert (first.metric, first.evidence["kind"]) == ("allocated", "leak")
    assert first.step == 160 + MemoryConfig().min_steps - 1  # as soon as the growth has lasted min_steps
    assert first.evidence["onset_step"] == 160
    assert "since step 160" in first.message and "no memory limit" in first.message
    assert {f.metric for f in found} == {"allocated"}  # reserved grows with it: not fragmentation


def test_fragmentation_is_found_within_a_few_steps_while_allocated_stays_flat():
    # memory_fragmentation_transformer's shape: cached blocks of the wrong size pile up, 0..6 MiB a step.
    piles = random.Random(5)
    piled = [0.0] * 120 + [piles.uniform(0, 6) * MiB for _ in range(280)]
    cached = [0.75 * MiB + sum(piled[: i + 1]) for i in range(400)]
    found = feed(
        MemoryGrowthDetector(MemoryConfig()), events(allocator(lambda s: 310 * KiB, cached.__getitem__), 400)
    )
    first = found[0]
    assert (first.metric, first.evidence["kind"]) == ("fragmentation", "fragmentation")
    assert 120 <= first.evidence["onset_step"] <= 121 and first.step <= 120 + 14
    assert all(f.metric == "fragmentation" for f in found)


def test_a_smaller_leak_is_found_once_it_matters():
    # 2.5 KB of logits a step: clear at once, but only a finding once it is min_growth of the memory.
    stream = events(allocator(lambda s: 362 * KiB + from_step(160, 2560)(s)), 400)
    first = feed(MemoryGrowthDetector(MemoryConfig()), stream)[0]
    assert first.evidence["kind"] == "leak" and first.evidence["onset_step"] == 160
    assert first.step - 160 <= 20 and first.evidence["growth_fraction"] >= MemoryConfig().min_growth
    stricter = feed(MemoryGrowthDetector(MemoryConfig(min_growth=0.2)), stream)[0]
    assert stricter.step > first.step


@pytest.mark.parametrize(
    "allocated, free",
    [
        # a planned batch-size increase: one step up (activations and the cache), then flat
        (lambda s: 362 * KiB * (1.5 if s >= 150 else 1), lambda s: 128 * KiB * (2 if s >= 150 else 1)),
        # the cache reaching a new batch size's level over 5 steps, then flat
        (lambda s: 362 * KiB, lambda s: 128 * KiB + min(max(0, s - 199), 5) * 200 * KiB),
        # eval buffers held for 10 steps every 50
        (lambda s: 362 * KiB + (2 * MiB if s % 50 < 10 else 0), lambda s: 128 * KiB),
    ],
    ids=["step up", "ramp that levels off", "eval buffers"],
)
def test_one_jump_a_ramp_that_levels_off_and_eval_buffers_are_not_growth(allocated, free):
    assert feed(MemoryGrowthDetector(MemoryConfig()), events(allocator(allocated, free), 400)) == []


def rss_swings(leak: Callable[[int], float] = lambda _s: 0.0, limit: int | None = None) -> Shape:
    """A CPU run's host RSS (3 GiB, 2 MiB of noise): 150 MiB of eval buffers held for 12 steps after
    every eval (every 50 steps), and a 150 MiB cache dropped at every checkpoint (every 100) and refilled
    over the next 20 steps: a steady climb, by 7.5 MiB a step, back to the old level."""

    def shape(step: int, rng: random.Random) -> dict:
        rss = 3 * GiB + rng.gauss(0, 2 * MiB) + leak(step)
        if step >= 50 and step % 50 < 12:
            rss += 150 * MiB
        if step >= 100 and step % 100 < 20:
            rss -= 150 * MiB * (1 - (step % 100) / 20)
        fields = {"host_rss": int(rss)}
        if limit is not None:
            fields |= {"cgroup_usage": int(rss + GiB), "cgroup_limit": limit}
        return fields

    return shape


@pytest.mark.parametrize("limit", [None, 8 * GiB])
@pytest.mark.parametrize("seed", range(4))
def test_host_rss_that_swings_around_evals_and_checkpoints_and_comes_back_is_quiet(seed, limit):
    detector = MemoryGrowthDetector(MemoryConfig())
    clear = 0.0  # the highest the CUSUM got: the refills are growth as far as it can tell
    for event in events(rss_swings(limit=limit), 800, seed):
        assert detector.update(event, event.ts) == []
        clear = max(clear, detector._series["host_rss"].cusum)
    assert clear >= MemoryConfig().threshold  # so the level to beat is what keeps them quiet


def test_a_leak_under_rss_swings_is_found_once_it_climbs_past_them():
    found = feed(
        MemoryGrowthDetector(MemoryConfig()), events(rss_swings(after_step(230, 4 * MiB), 8 * GiB), 600)
    )
    first = found[0]
    assert (first.metric, first.evidence["kind"]) == ("host_rss", "leak")
    assert 230 < first.step <= 330 and first.evidence["seconds_to_limit"] < 3600
    assert first.value > first.evidence["level_to_beat_bytes"] > 3 * GiB + 150 * MiB  # past the swings' peak


def after_step(onset: int, per_step: float) -> Callable[[int], float]:
    return lambda step: max(0, step - onset) * per_step


def test_the_test_pickles_mid_episode_and_resumes_with_the_same_findings():
    stream = events(allocator(lambda s: 362 * KiB + from_step(160, 108 * KiB)(s)), 400)
    whole = feed(MemoryGrowthDetector(MemoryConfig()), stream)
    first = MemoryGrowthDetector(MemoryConfig())
    before = feed(first, stream[:165])  # inside the episode, before its finding
    assert before == [] and first._series["allocated"].onset == 160
    assert before + feed(pickle.loads(pickle.dumps(first)), stream[165:]) == whole


# A MemoryGrowthDetector pickled by the fixed-window version (3 steps of allocated, reserved, host RSS).
OLD_SNAPSHOT = (
    "eNqlUs9rFDEU3rbs7mzX9lAUES89tghrbRUERbdUWOhgD+I9ZCfZZmAm2U0yu60gqGD1EFBoPOipf4D/gDeP/h/ePPkf1Jf5Xban"
    "mmEg3/deXr73vbxpftltNtJl1mXCZ1gHrEeopoEWUvViGgt5jA6lmGlmzfXnKR6k8FmeZU/t5lv72m6YViD4KDy0rGGuZZl7GVFm"
    "eAiRMNAIpahNOR5GlNiPpjULOREz6xOzHIccjUXItSphLmDw9MdXt76ZlmPlNjC/d9JlVmdYcsSEDF8JjpQd9L+vZ42tBTLUYYCj"
    "C9F3P7PoaiBEBFcDq+kYrvyVmDWExscEcziF6JGWGAQfmJs1dhTSiCikqOvlEzhTi41lOMWaujPJ0CwhvWWNR4DRYUzr21O7t9z+"
    "073RSZVYdst4jgeFLgaw4yChkcaA/Yb7PtgX9j38J/CbNtKScqJSNzs4ikQAtYkbQAu9dKHM+gMXXwrE1A4a+TJdOoVJUIJifGQH"
    "539zeiXCSkNfUwqmHcOlppMxYI71F8F4ijnSYHxxImOgdP9zzixwAF4OvMJfa25f8sKqqLdXbCvNy5MkBItHUsROSjeDCdgc2f1z"
    "WMmJHZq2wvE4osqabiCiCCqHggNqEjpJnJWbPnF+bZTdl1pPqkbqXH8+j5pm9kDYblEO5rHgL1LjqSRGauJcKQ6WXM1ytuKTVO/K"
    "SOLDmHKNnVDL7uTtsl6Ve7ccCdvyG+yev8i2S6lsp9reL61mD9jDotIjOPO4dIg9qURXHhQl6h7UuP58HmWDue7ZfpnJ/PlePSbg"
    "9UilrtZm/+y/2yxKXBj12SWjPrt6m0ky7P0D7LetmA=="
)


def test_a_snapshot_from_before_the_sequential_test_loads_and_starts_afresh():
    restored = pickle.loads(zlib.decompress(base64.b64decode(OLD_SNAPSHOT)))
    assert restored.config.threshold == MemoryConfig().threshold  # the new knobs at their defaults
    assert "_trends" not in vars(restored)
    stream = events(allocator(lambda s: 362 * KiB + from_step(160, 108 * KiB)(s)), 400)
    later = [e.model_copy(update={"step": e.step + 3}) for e in stream]  # it had seen steps 0..2
    found = feed(restored, later)
    assert found and found[0].evidence["onset_step"] == 163


def test_config_rejects_min_steps_beyond_the_window():
    with pytest.raises(ValueError, match="min_steps"):
        MemoryConfig(window=20, min_points=20, min_steps=30)


def test_host_swings_really_move_the_measured_rss_and_give_it_back():
    swings = HostSwings(mib=32, hold=2, refill=4)
    sampler = MemorySampler("cpu")

    def rss() -> int:
        sample = sampler.sample()
        assert sample is not None and sample.host_rss is not None  # /proc is there on Linux
        return sample.host_rss

    base = rss()
    swings.after_eval(step=0)
    assert rss() - base >= 30 * MiB  # the eval's buffers are resident
    swings.after_step(1)
    swings.after_step(2)  # their time is up; the cache grows by a quarter each step
    assert 14 * MiB <= rss() - base <= 18 * MiB
    swings.at_checkpoint()
    assert rss() - base <= 2 * MiB


def test_one_jump_counts_as_a_few_ordinary_steps_however_large():
    detector = MemoryGrowthDetector(MemoryConfig())
    feed(detector, events(allocator(lambda s: 362 * KiB * (10 if s >= 150 else 1)), 151))
    cfg = MemoryConfig()
    assert detector._series["allocated"].cusum == pytest.approx(3.0 - cfg.allowance)  # clipped at 3 scales


@pytest.mark.parametrize("seed", range(8))
def test_a_noisy_ramp_to_a_new_batch_size_s_level_is_not_a_leak(seed):
    # A CUDA rank: 10 GiB allocated with 30 MiB of batch-shape noise, 4 GiB more reached over 5 steps. The
    # noise can start the episode a step or two early, so the fit's quarters still rise as the ramp ends:
    # the newest quarter's own rate, flat, says it has levelled off.
    def shape(step: int, rng: random.Random) -> dict:
        allocated = 10 * GiB + min(max(0, step - 399), 5) * 0.8 * GiB + rng.gauss(0, 30 * MiB)
        return {"allocated": int(allocated), "reserved": int(allocated + 2 * GiB), "device_total": 80 * GiB}

    assert feed(MemoryGrowthDetector(MemoryConfig()), events(shape, 600, seed)) == []


def _pickled_without_levels(detector: MemoryGrowthDetector) -> bytes:
    """``detector`` pickled as the code before each series kept its levels apart pickled it: every
    ``_Series`` as its ``__slots__`` state without ``levels`` (they were read from the history)."""

    class OldFormat(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if not isinstance(obj, _Series):
                return NotImplemented
            slots = {name: getattr(obj, name) for name in _Series.__slots__ if name != "levels"}
            return copyreg.__newobj__, (_Series,), (None, slots)

    out = io.BytesIO()
    OldFormat(out).dump(detector)
    return out.getvalue()


def test_a_series_pickled_before_it_kept_its_levels_apart_loads_and_carries_on():
    stream = events(allocator(lambda s: 362 * KiB + from_step(160, 108 * KiB)(s)), 400, seed=3)
    whole = feed(MemoryGrowthDetector(MemoryConfig()), stream)
    first = MemoryGrowthDetector(MemoryConfig())
    before = feed(first, stream[:165])  # inside the episode, before its finding
    old = _pickled_without_levels(first)
    assert b"levels" not in old  # (the old format indeed)
    restored = pickle.loads(old)
    for series in restored._series.values():  # the levels are rebuilt from the history, window and all
        assert list(series.levels) == [mib for _, _, mib in series.history]
        assert series.levels.maxlen == series.history.maxlen
    assert whole and before + feed(restored, stream[165:]) == whole
