"""GPU health in the evidence (issue 38): the worker keeps each rank's NVML figures from its heartbeats and
the straggler, throughput-drift and hung-rank findings carry the named rank's, with since when each throttle
reason has been active ("rank 2: thermal throttle since 12:04:11 (SM clock 1110 of 1980 MHz)")."""

from __future__ import annotations

import math
import pickle
import random
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import GpuHealth, HeartbeatEvent, RunStartEvent, StepEvent
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.config import ThroughputConfig
from runwatch.detectors.gpu_health import GpuHealthTracker, describe
from runwatch.detectors.throughput import ThroughputDetector
from runwatch.producer.instrument.gpu_health import GpuHealthSampler
from tests.support.fake_nvml import SW_THERMAL, FakeDevice, FakeNvml

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
RUN = "gpu-run"
RANKS = 4
SLOW = 2
THROTTLE_AT = 40  # the step from which rank 2's clock is capped (and it computes slower)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class ClockAt:
    """A fake monotonic clock the samplers share: the run's event time in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def four_rank_run(seed: int = 0) -> list:
    """Four DDP ranks (step events with compute_s, heartbeats every 5 steps whose ``gpu`` comes from a
    GpuHealthSampler over a fake NVML per rank): from THROTTLE_AT rank 2's NVML reports its SM clock capped
    at 1110 of 1980 MHz with the thermal throttle reason, and it computes 1.8x slower."""
    rng = random.Random(seed)
    clock = ClockAt()
    devices = {r: FakeDevice() for r in range(RANKS)}
    samplers = {r: GpuHealthSampler(r, nvml=FakeNvml({r: devices[r]}), clock=clock) for r in range(RANKS)}
    events: list = [RunStartEvent(run_id=RUN, ts=T0, world_size=RANKS, event_id="start")]
    t = 0.0
    for step in range(120):
        t += 0.25
        clock.now = t
        if step == THROTTLE_AT:
            devices[SLOW].sm_clock, devices[SLOW].reasons, devices[SLOW].temperature = 1110, SW_THERMAL, 91
        for rank in range(RANKS):
            slow = rank == SLOW and step >= THROTTLE_AT
            events.append(
                StepEvent(
                    run_id=RUN,
                    rank=rank,
                    step=step,
                    ts=at(t) + timedelta(milliseconds=rank),
                    event_id=f"s{step}r{rank}",
                    loss=1.0,
                    step_time_s=0.25,
                    compute_s=0.1 * math.exp(rng.gauss(0, 0.03)) * (1.8 if slow else 1.0),
                )
            )
            if step % 5 == 0:
                events.append(
                    HeartbeatEvent(
                        run_id=RUN,
                        rank=rank,
                        step=step,
                        ts=at(t) + timedelta(milliseconds=rank),
                        event_id=f"h{step}r{rank}",
                        interval_s=1.25,
                        gpu=samplers[rank].sample(),
                    )
                )
    return events


def test_the_straggler_finding_names_rank_2_and_carries_its_throttle_reason():
    monitor = RunMonitor(RUN, RunwatchConfig())
    anomalies = [a for e in four_rank_run() for a in monitor.observe(e).anomalies]
    stragglers = [a for a in anomalies if a.detector == "straggler"]
    assert [a.rank for a in stragglers] == [SLOW]
    finding = stragglers[0]
    gpu = finding.evidence["gpu"]
    assert gpu["rank"] == SLOW
    assert gpu["latest"]["throttle_reasons"] == ["sw_thermal_slowdown"]
    assert gpu["latest"]["sm_clock_mhz"] == 1110 and gpu["latest"]["sm_clock_max_mhz"] == 1980
    # since the first heartbeat that reported it: step 40's, at 10.25 s (+ rank 2's 2 ms)
    since = datetime.fromisoformat(gpu["throttle_since"]["sw_thermal_slowdown"])
    assert since == at(0.25 * (THROTTLE_AT + 1)) + timedelta(milliseconds=SLOW)
    assert gpu["slowing"] == ["sw_thermal_slowdown"]
    assert "rank 2: thermal throttle since 12:00:10 (SM clock 1110 of 1980 MHz, 91 °C)" in finding.message
    # the state pickles with plain data (the worker snapshots it)
    assert pickle.loads(pickle.dumps(monitor)).cross_rank_detectors


def test_a_streak_ends_when_a_heartbeat_does_not_report_the_reason_and_no_gpu_ends_none():
    tracker = GpuHealthTracker()

    def beat(s: float, reasons: list[str] | None) -> None:
        gpu = None if reasons is None else GpuHealth(sm_clock_mhz=1500, throttle_reasons=reasons)
        tracker.observe(HeartbeatEvent(run_id=RUN, step=1, ts=at(s), gpu=gpu))

    beat(1, ["sw_power_cap"])
    beat(2, ["sw_power_cap", "hw_slowdown"])
    beat(3, None)  # (a beat with no gpu says nothing)
    assert tracker.since == {"sw_power_cap": at(1).isoformat(), "hw_slowdown": at(2).isoformat()}
    beat(4, ["hw_slowdown"])
    beat(5, ["sw_power_cap", "hw_slowdown", "gpu_idle"])
    assert tracker.since == {
        "hw_slowdown": at(2).isoformat(),
        "sw_power_cap": at(5).isoformat(),
        "gpu_idle": at(5).isoformat(),
    }
    beat(0.5, [])  # an older heartbeat, late: ignored
    evidence = tracker.evidence(7)
    assert evidence is not None and evidence["slowing"] == ["sw_power_cap", "hw_slowdown"]
    assert describe(evidence) == "rank 7: power cap and hardware slowdown since 12:00:02 (SM clock 1500 MHz)"
    beat(6, [])
    assert describe(tracker.evidence(7)) == "rank 7: GPU not throttled (SM clock 1500 MHz)"


def test_a_throughput_drift_carries_the_ranks_gpu_health():
    detector = ThroughputDetector(ThroughputConfig())
    rng = random.Random(1)
    found, t = [], 0.0
    for step in range(400):
        slow = step >= 200
        step_time = (0.5 if slow else 0.25) * math.exp(rng.gauss(0, 0.02))
        t += step_time
        event = StepEvent(run_id=RUN, rank=2, step=step, ts=at(t), step_time_s=step_time)
        found += detector.update(event, event.ts)
        if step % 5 == 0:
            gpu = GpuHealth(
                sm_clock_mhz=1110 if slow else 1980,
                sm_clock_max_mhz=1980,
                throttle_reasons=["hw_thermal_slowdown"] if slow else [],
            )
            beat = HeartbeatEvent(run_id=RUN, rank=2, step=step, ts=at(t), interval_s=1.25, gpu=gpu)
            found += detector.update(beat, beat.ts)
    assert found, "the drift is found"
    finding = found[0]
    assert finding.evidence["gpu"]["latest"]["throttle_reasons"] == ["hw_thermal_slowdown"]
    assert "rank 2: hardware thermal slowdown since" in finding.message
    assert "(SM clock 1110 of 1980 MHz)" in finding.message


def test_a_hung_rank_carries_its_gpu_health():
    """Rank 1 stops stepping, beats on; its peers wait for it in the gradient sync. Its GPU reports the power
    brake: the hung_rank finding says so."""
    monitor = RunMonitor(RUN, RunwatchConfig())
    monitor.observe(RunStartEvent(run_id=RUN, ts=T0, world_size=2, event_id="start"))
    t = 0.0
    for step in range(20):
        t += 0.25
        for rank in range(2):
            monitor.observe(
                StepEvent(
                    run_id=RUN, rank=rank, step=step, ts=at(t), loss=1.0, step_time_s=0.25, compute_s=0.1
                )
            )
    found = []
    for beat in range(1, 30):
        ts = at(t + 1.25 * beat)
        for rank in range(2):
            gpu = GpuHealth(sm_clock_mhz=600, sm_clock_max_mhz=1980, throttle_reasons=["hw_power_brake"])
            monitor.observe(
                HeartbeatEvent(
                    run_id=RUN,
                    rank=rank,
                    step=19,
                    ts=ts,
                    interval_s=1.25,
                    in_sync=rank != 1,
                    gpu=gpu if rank == 1 else GpuHealth(sm_clock_mhz=1980, sm_clock_max_mhz=1980),
                )
            )
        found += [a for a in monitor.tick(ts).anomalies if a.detector == "hung_rank"]
    assert [a.rank for a in found] == [1]
    assert found[0].evidence["gpu"]["latest"]["throttle_reasons"] == ["hw_power_brake"]
    assert "rank 1: power brake since" in found[0].message
