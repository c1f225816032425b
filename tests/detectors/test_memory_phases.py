"""memory_growth tests the training steps' memory (issue 37, item 6): a rise across a step that contained an
eval or a checkpoint is the phase's and is set aside, so a ratchet at the evals that lifts a cache's refill
past its old level is not a leak; a leak in the training steps is found as fast as before, however often
the run evaluates; falls count wherever they happen; the state still pickles; the scenario's ratchet really
keeps the measured RSS up. Every series is seeded."""

from __future__ import annotations

import copyreg
import io
import pickle
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import (
    CheckpointEvent,
    EvalEvent,
    HeartbeatEvent,
    MemoryStats,
    StepEvent,
    TelemetryEvent,
)
from runwatch.detectors.findings import Finding
from runwatch.detectors.memory_growth import MemoryConfig, MemoryGrowthDetector, _Series
from runwatch.producer.instrument.memory import MemorySampler
from runwatch.scenarios.memory import HostSwings

T0 = datetime(2026, 11, 24, 9, 0, tzinfo=UTC)
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
EVAL_EVERY, CHECKPOINT_EVERY = 25, 90


def _at(step: int, offset_s: float = 0.0) -> datetime:
    return T0 + timedelta(seconds=step * 0.25 + offset_s)


def stream(
    rss: Callable[[int, random.Random], float],
    steps: int = 400,
    seed: int = 0,
    eval_every: int | None = EVAL_EVERY,
    checkpoint_every: int | None = CHECKPOINT_EVERY,
    heartbeat_phase: bool = False,
) -> list[TelemetryEvent]:
    """Step events with ``rss(step)`` as host RSS and, after step s, a checkpoint event where
    ``(s + 1) % checkpoint_every == 0`` and an eval event where ``(s + 1) % eval_every == 0``, in the
    order the producer sends them (with ``heartbeat_phase``, a heartbeat in the phase instead of the
    phase's own event)."""
    rng = random.Random(seed)
    out: list[TelemetryEvent] = []
    for s in range(steps):
        out.append(StepEvent(run_id="r", step=s, ts=_at(s), memory=MemoryStats(host_rss=int(rss(s, rng)))))
        for every, phase in ((checkpoint_every, "checkpoint"), (eval_every, "eval")):
            if every is None or (s + 1) % every:
                continue
            if heartbeat_phase:
                out.append(HeartbeatEvent(run_id="r", step=s, ts=_at(s, 0.1), phase=phase))  # type: ignore[arg-type]
            elif phase == "checkpoint":
                out.append(CheckpointEvent(run_id="r", step=s, ts=_at(s, 0.1), uri=f"mem://r/{s}"))
            else:
                out.append(EvalEvent(run_id="r", step=s, ts=_at(s, 0.2), loss=1.0))
    return out


def feed(detector: MemoryGrowthDetector, events: list[TelemetryEvent]) -> list[Finding]:
    found: list[Finding] = []
    for event in events:
        found += detector.update(event, event.ts)
    return found


def without_phases(events: list[TelemetryEvent]) -> list[TelemetryEvent]:
    """The same memory samples, the detector told of no eval or checkpoint."""
    return [e for e in events if isinstance(e, StepEvent)]


def ratchet(
    leak: Callable[[int], float] = lambda _s: 0.0, kept_mib: float = 30
) -> Callable[[int, random.Random], float]:
    """healthy_cpu_rss_ratchet_mlp's shape (400 MiB, 0.25 MiB of noise): each of the first 5 evals (every 25
    steps) keeps 30 MiB more for good (the allocator's high-water mark); a 150 MiB cache filled over the
    first 40 steps, dropped at every checkpoint (every 90) and refilled over the next 40, so the refill
    after the first checkpoint, with two of those evals in it, ends 60 MiB above where it was."""

    def rss(step: int, rng: random.Random) -> float:
        kept = kept_mib * MiB * min(5, step // EVAL_EVERY)  # eval after step 24 first shows at step 25
        since = step % CHECKPOINT_EVERY if step >= CHECKPOINT_EVERY else step + 1
        cache = 150 * MiB * min(1.0, since / 40)
        return 400 * MiB + kept + cache + rng.gauss(0, 0.25 * MiB) + leak(step)

    return rss


def after_step(onset: int, per_step: float) -> Callable[[int], float]:
    return lambda step: max(0, step - onset) * per_step


@pytest.mark.parametrize("seed", range(4))
def test_a_ratchet_at_the_evals_inside_a_refill_is_not_a_leak(seed):
    events = stream(ratchet(), seed=seed)
    # Told nothing of the evals, the refill past its old level is growth (the held-out false alarm).
    blind = feed(MemoryGrowthDetector(MemoryConfig()), without_phases(events))
    assert blind and blind[0].metric == "host_rss" and 90 < blind[0].step < 140
    detector = MemoryGrowthDetector(MemoryConfig())
    assert feed(detector, events) == []
    # (MiB) the 5 evals' 30, and the steps' own noise and refill where the eval's step rose anyway
    assert 150 <= detector._series["host_rss"].set_aside <= 190


def test_a_heartbeat_in_the_eval_or_checkpoint_phase_marks_the_step_too():
    assert feed(MemoryGrowthDetector(MemoryConfig()), stream(ratchet(), heartbeat_phase=True)) == []


def test_a_fall_across_a_phase_step_is_counted_and_nothing_is_set_aside():
    # The cache dropped at a checkpoint: the step falls, the training steps refill it to its old level.
    detector = MemoryGrowthDetector(MemoryConfig())
    events = stream(ratchet(kept_mib=0), eval_every=None)  # no eval: the checkpoints' steps only fall
    assert feed(detector, events) == []
    assert detector._series["host_rss"].set_aside == 0.0


@pytest.mark.parametrize("eval_every", [None, 50, 25, 10, 1])
def test_a_leak_in_the_training_steps_is_found_as_fast_however_often_the_run_evaluates(eval_every):
    # 4 MiB a step from step 160 on a flat 400 MiB: the finding once the growth has lasted min_steps.
    leak = after_step(160, 4 * MiB)

    def rss(step: int, rng: random.Random) -> float:
        return 400 * MiB + rng.gauss(0, 0.25 * MiB) + leak(step)

    expected = feed(MemoryGrowthDetector(MemoryConfig()), stream(rss, 400, 1, None, None))[0]
    assert expected.step <= 160 + 12  # (the noise can start the episode a step or two early)
    events = stream(rss, 400, 1, eval_every, None)
    first = feed(MemoryGrowthDetector(MemoryConfig()), events)[0]
    assert (first.metric, first.evidence["kind"]) == ("host_rss", "leak")
    # Every eval step a 10th of the growth is set aside (one step in min_steps): a step later at most.
    assert expected.step <= first.step <= expected.step + (eval_every == 1)


def test_at_most_one_step_in_min_steps_is_set_aside():
    detector = MemoryGrowthDetector(MemoryConfig())
    feed(detector, stream(lambda s, _rng: 400 * MiB + s * MiB, 100, eval_every=1, checkpoint_every=None))
    series = detector._series["host_rss"]
    assert series.set_aside == pytest.approx(10 * 1.0)  # steps 1, 11, ..., 91: 1 MiB each
    assert series.last_set_aside == 91


def test_a_leak_under_the_ratchet_is_found_once_the_training_steps_climb_past_it():
    events = stream(ratchet(after_step(230, 4 * MiB)), 600)
    first = feed(MemoryGrowthDetector(MemoryConfig()), events)[0]
    assert (first.metric, first.evidence["kind"]) == ("host_rss", "leak")
    # As under the swings that come back (test_memory_sequential): within 100 steps, the level to beat
    # the highest the training steps' memory had.
    assert 230 < first.step <= 330 and first.evidence["set_aside_bytes"] > 100 * MiB
    assert first.value > first.evidence["level_to_beat_bytes"] + first.evidence["set_aside_bytes"]


def test_the_phase_state_pickles_mid_episode_and_resumes_with_the_same_findings():
    events = stream(ratchet(after_step(230, 4 * MiB)), 600, seed=2)
    whole = feed(MemoryGrowthDetector(MemoryConfig()), events)
    cut = next(i for i, e in enumerate(events) if isinstance(e, EvalEvent) and e.step == 224) + 1
    first = MemoryGrowthDetector(MemoryConfig())
    before = feed(first, events[:cut])  # an eval seen, its step's memory not yet
    assert before == [] and first._phase
    assert whole and before + feed(pickle.loads(pickle.dumps(first)), events[cut:]) == whole


def test_a_snapshot_from_before_the_phases_were_seen_loads_and_carries_on():
    events = stream(ratchet(), seed=3)
    detector = MemoryGrowthDetector(MemoryConfig())
    feed(detector, without_phases(events)[:60])

    class OldFormat(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if not isinstance(obj, _Series):
                return NotImplemented
            new = ("set_aside", "last_set_aside")
            slots = {name: getattr(obj, name) for name in _Series.__slots__ if name not in new}
            return copyreg.__newobj__, (_Series,), (None, slots)

    del detector.__dict__["_phase"]
    out = io.BytesIO()
    OldFormat(out).dump(detector)
    assert b"set_aside" not in out.getvalue() and b"_phase" not in out.getvalue()
    restored = pickle.loads(out.getvalue())
    assert restored._phase is False and restored._series["host_rss"].set_aside == 0.0
    assert feed(restored, [e for e in events if not isinstance(e, StepEvent) or e.step >= 60]) == []


def test_the_scenario_s_ratchet_really_keeps_the_measured_rss_up_and_plateaus():
    swings = HostSwings(mib=0, eval_mib=0, ratchet_mib=16, ratchet_evals=2)
    sampler = MemorySampler("cpu")

    def rss() -> int:
        sample = sampler.sample()
        assert sample is not None and sample.host_rss is not None  # /proc is there on Linux
        return sample.host_rss

    base = rss()
    swings.after_eval(step=24)
    assert 15 * MiB <= rss() - base <= 18 * MiB  # the first eval's pages, resident
    swings.after_step(25)
    swings.at_checkpoint()
    swings.after_eval(step=49)
    swings.after_eval(step=74)  # the high-water mark reached: no more
    assert 31 * MiB <= rss() - base <= 35 * MiB
