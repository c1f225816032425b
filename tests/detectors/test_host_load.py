"""Contention evidence and detection time (issue 12): heartbeats carry the host's load (absent where a
figure is unavailable, never zero), throughput and data-wait findings say whether the host got busier
at their onset by the documented rule (and are emitted either way), and the worker stamps each anomaly
with its own clock (``detected_at``) while the pure monitor and offline replay leave it unset."""

from __future__ import annotations

import math
import pickle
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from runwatch.contract.schema import (
    Anomaly,
    HeartbeatEvent,
    HostLoad,
    SchemaError,
    StepEvent,
    decode_anomaly,
    decode_event,
)
from runwatch.detectors import RunwatchConfig
from runwatch.detectors.config import DataWaitConfig, ThroughputConfig
from runwatch.detectors.data_wait import DataWaitDetector
from runwatch.detectors.host_load import (
    HostLoadTracker,
    annotate,
    busier_reasons,
    contention,
    describe,
    saturated,
)
from runwatch.detectors.offline.replay import replay
from runwatch.detectors.throughput import ThroughputDetector
from runwatch.producer import MemoryDelivery
from runwatch.producer.instrument import heartbeat as heartbeat_module
from runwatch.producer.instrument.heartbeat import Heartbeat, HostLoadSampler
from runwatch.producer.publish.run_watch import RunWatch
from runwatch.worker.processor import TelemetryProcessor
from tests.support.action_keys import SEED

T0 = datetime(2026, 5, 1, tzinfo=UTC)


def _ts(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# -- the wire ---------------------------------------------------------------------------------------


def _heartbeat_json(host_load: str) -> str:
    return (
        '{"schema_version":1,"event_id":"h1","run_id":"r","rank":0,"ts":"2026-05-01T00:00:00Z",'
        f'"kind":"heartbeat","step":3,"phase":"train","interval_s":5.0,"host_load":{host_load}}}'
    )


def test_heartbeat_host_load_decodes_and_every_figure_is_optional():
    event = decode_event(
        _heartbeat_json('{"load1":1.5,"cpus":8,"steal_frac":0.02,"process_cpu_frac":3.9,"cpu_wait_frac":0.1}')
    )
    assert event.host_load == HostLoad(
        load1=1.5, cpus=8, steal_frac=0.02, process_cpu_frac=3.9, cpu_wait_frac=0.1
    )
    assert decode_event(_heartbeat_json('{"load1":2}')).host_load.steal_frac is None
    assert decode_event(_heartbeat_json("{}")).host_load == HostLoad()
    plain = HeartbeatEvent(run_id="r", step=1)
    assert b"host_load" not in plain.to_json()  # absent, not null or zero


@pytest.mark.parametrize(
    "bad",
    [
        '{"load1":-1}',
        '{"load1":"NaN"}',
        '{"steal_frac":1.5}',
        '{"cpus":0}',
        '{"cpus":2.0}',
        '{"cpu_wait_frac":-0.1}',
        '{"process_cpu_frac":"Infinity"}',
        '{"load1":"1.0"}',
    ],
)
def test_out_of_bounds_host_load_is_refused(bad):
    with pytest.raises(SchemaError, match="host_load"):
        decode_event(_heartbeat_json(bad))


def test_anomaly_detected_at_round_trips_and_is_absent_when_unset():
    base = dict(
        anomaly_id="a1",
        run_id="r",
        step=4,
        detector="throughput_drift",
        metric="step_time_s",
        severity="warning",
        message="m",
        ts=_ts(0),
    )
    unset = Anomaly(**base)
    assert unset.detected_at is None and b"detected_at" not in unset.to_json()
    stamped = Anomaly(**base, detected_at=_ts(0.25))
    back = decode_anomaly(stamped.to_json())
    assert back.detected_at == _ts(0.25) and (back.detected_at - back.ts).total_seconds() == 0.25
    assert back.anomaly_id == unset.anomaly_id


# -- the producer's sampler ---------------------------------------------------------------------------


class Wall:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_sampler_gives_load_now_and_period_shares_from_the_second_sample(monkeypatch):
    stat = iter([(100, 10_000), (150, 10_200)])
    delay = iter([1_000_000_000, 1_500_000_000])
    cpu = iter([10.0, 10.8])
    monkeypatch.setattr(heartbeat_module, "_proc_stat_cpu", lambda: next(stat))
    monkeypatch.setattr(heartbeat_module, "_run_delay_ns", lambda: next(delay))
    monkeypatch.setattr(heartbeat_module.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(heartbeat_module.os, "getloadavg", lambda: (1.25, 1.0, 0.5))
    monkeypatch.setattr(heartbeat_module.os, "cpu_count", lambda: 4)
    wall = Wall()
    sampler = HostLoadSampler(clock=wall)
    assert sampler.sample() == {"load1": 1.25, "cpus": 4}  # no period yet: no shares (not zeros)
    wall.now += 2.0
    assert sampler.sample() == {
        "load1": 1.25,
        "cpus": 4,
        "process_cpu_frac": 0.4,
        "steal_frac": 0.25,
        "cpu_wait_frac": 0.25,
    }


def test_sampler_leaves_out_what_the_host_does_not_offer(monkeypatch):
    def no_loadavg():
        raise OSError("no load average here")

    monkeypatch.setattr(heartbeat_module.os, "getloadavg", no_loadavg)
    monkeypatch.setattr(heartbeat_module.os, "cpu_count", lambda: None)
    monkeypatch.setattr(heartbeat_module, "_proc_stat_cpu", lambda: None)
    monkeypatch.setattr(heartbeat_module, "_run_delay_ns", lambda: None)
    wall = Wall()
    sampler = HostLoadSampler(clock=wall)
    assert sampler.sample() is None
    wall.now += 1.0
    assert set(sampler.sample()) == {"process_cpu_frac"}  # time.process_time is everywhere


def test_sampler_reads_this_linux_host():
    import time

    # This process's CPU share over the period is what it really got: close to 1 on a quiet machine, less
    # where other jobs share the cores; compared with what time.process_time says it used.
    sampler = HostLoadSampler()
    started, cpu_started = time.monotonic(), time.process_time()
    first = sampler.sample()
    assert first["cpus"] >= 1 and first["load1"] >= 0
    while time.process_time() - cpu_started < 0.3 and time.monotonic() - started < 10:
        pass  # burn CPU
    second = sampler.sample()
    used = (time.process_time() - cpu_started) / (time.monotonic() - started)
    assert 0 < second["process_cpu_frac"] <= first["cpus"]
    assert second["process_cpu_frac"] == pytest.approx(used, abs=0.15)
    assert 0 <= second["steal_frac"] <= 1 and second["cpu_wait_frac"] >= 0
    HostLoad(**second)


class Captured(RunWatch):
    """A real RunWatch that keeps what it would send (rank 1: no run_start to skip)."""

    def __init__(self) -> None:
        super().__init__("hb-run", rank=1, world_size=2, delivery=MemoryDelivery())

    @property
    def events(self) -> list:
        return self.delivery.events


def test_heartbeats_of_a_runwatch_publisher_carry_host_load():
    rw = Captured()
    hb = Heartbeat(rw, interval_s=0.5)
    hb.set_step(7)
    assert hb.beat() and hb.beat()
    first, second = rw.events
    assert isinstance(first, HeartbeatEvent) and first.step == 7 and first.interval_s == 0.5
    assert first.host_load.cpus >= 1 and first.host_load.process_cpu_frac is None
    assert decode_event(second.to_json()).host_load == second.host_load


def test_simulated_clocks_and_foreign_publishers_send_no_host_load():
    rw = Captured()
    Heartbeat(rw, clock=Wall()).beat()  # a run on a clock of its own: no real-host figures
    assert rw.events[-1].host_load is None

    calls = []

    class Minimal:  # a publisher whose heartbeat() knows nothing of host_load
        def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None):
            calls.append(step)
            return True

    assert Heartbeat(Minimal()).beat() and calls == [None]


# -- the tracker and the busier rule -------------------------------------------------------------------


def _hb(step: int, **host) -> HeartbeatEvent:
    return HeartbeatEvent(run_id="r", step=step, ts=_ts(step), host_load=HostLoad(**host))


def _tracker(
    before: dict, after: dict, n_before: int = 10, n_after: int = 3, onset: int = 100
) -> HostLoadTracker:
    t = HostLoadTracker()
    for i in range(n_before):
        t.observe(_hb(onset - 10 * (n_before - i), cpus=2, **before))
    for i in range(n_after):
        t.observe(_hb(onset + 5 * i, cpus=2, **after))
    return t


@pytest.mark.parametrize(
    ("before", "after", "reasons"),
    [
        ({"load1": 1.0}, {"load1": 3.4}, ["load"]),  # +1.2 per CPU, 3.4x
        ({"load1": 1.0}, {"load1": 1.6}, []),  # +0.3 per CPU: below the rise
        ({"load1": 4.0}, {"load1": 5.2}, []),  # +0.6 per CPU but only 1.3x
        ({"steal_frac": 0.01}, {"steal_frac": 0.2}, ["steal"]),
        ({"steal_frac": 0.01}, {"steal_frac": 0.08}, []),
        ({"cpu_wait_frac": 0.02}, {"cpu_wait_frac": 0.9}, ["cpu_wait"]),
        ({"cpu_wait_frac": 0.3}, {"cpu_wait_frac": 0.5}, []),  # +0.2: below the rise
        # own share: no say
        ({"load1": 1.0, "process_cpu_frac": 1.9}, {"load1": 1.0, "process_cpu_frac": 0.4}, []),
    ],
)
def test_busier_rule(before, after, reasons):
    evidence = _tracker(before, after).evidence(100)
    assert evidence["reasons"] == reasons and evidence["busier"] is bool(reasons)
    assert busier_reasons(evidence["before"], evidence["now"]) == reasons


def test_before_is_the_median_before_the_onset_and_now_the_heartbeats_mostly_after_it():
    t = HostLoadTracker()
    # the heartbeat at step 100 covers steps 41..100: mostly before the onset at 95, so neither side's
    for step, load in [
        (10, 1.0),
        (20, 9.0),
        (30, 1.2),
        (40, 0.8),
        (100, 2.5),
        (102, 3.0),
        (110, 3.5),
        (120, 3.3),
    ]:
        t.observe(_hb(step, load1=load, cpus=2, cpu_wait_frac=load / 10))
    ev = t.evidence(95)
    assert ev["before"]["load1"] == pytest.approx(1.1) and ev["before"]["samples"] == 4
    assert ev["now"]["load1"] == 3.3 and ev["now"]["cpu_wait_frac"] == pytest.approx(0.33)  # latest; median
    assert (ev["now"]["samples"], ev["now"]["first_step"], ev["now"]["last_step"]) == (3, 102, 120)
    assert ev["busier"] is True and ev["reasons"] == ["load"]  # (cpu_wait rose by 0.22: below the rise)


def test_no_claim_without_a_sample_on_both_sides_or_a_comparable_figure():
    only_own_share = _tracker({"process_cpu_frac": 1.9}, {"process_cpu_frac": 0.4}).evidence(100)
    assert only_own_share["busier"] is None and describe(only_own_share) == ""
    assert HostLoadTracker().evidence(100) is None
    t = HostLoadTracker()
    t.observe(_hb(50, load1=1.0, cpus=2))
    ev = t.evidence(100)  # nothing measured since the onset yet
    assert ev["busier"] is None and ev["now"] is None and describe(ev) == ""
    t.observe(HeartbeatEvent(run_id="r", step=120, ts=_ts(120)))  # a heartbeat without host_load
    assert t.evidence(100)["busier"] is None


def test_messages():
    busy = _tracker({"load1": 1.0, "cpu_wait_frac": 0.02}, {"load1": 3.4, "cpu_wait_frac": 0.9}).evidence(100)
    assert describe(busy) == (
        "; host busier at the same step: load 1.0 → 3.4 on 2 CPUs, this process waited "
        "for a CPU 2% → 90% of the time"
    )
    calm = _tracker({"load1": 1.0}, {"load1": 1.1}).evidence(100)
    assert describe(calm) == "; host load unchanged (1.0 → 1.1 on 2 CPUs)"


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ({"load1": 6.5, "cpus": 2}, True),  # 3.2 per CPU
        ({"load1": 1.5, "cpus": 2}, False),
        # this process waits for a CPU 40% of the time
        ({"load1": 1.0, "cpus": 2, "cpu_wait_frac": 0.4}, True),
        ({"load1": 1.0, "cpus": 2, "steal_frac": 0.15}, True),
        ({"load1": 2.2, "cpus": 2, "cpu_wait_frac": 0.14}, False),  # 1.1 per CPU, but the run barely waits
        ({"process_cpu_frac": 0.9}, None),  # nothing of the rule known
        (None, None),
    ],
)
def test_saturated(side, expected):
    assert saturated(side) is expected


SAT = {"load1": 6.5, "process_cpu_frac": 0.4, "cpu_wait_frac": 0.6}


@pytest.mark.parametrize(
    ("before", "after", "slowdown", "cause", "by"),
    [
        # more jobs on a saturated host: the CPU share the run lost went to waiting for a CPU
        (SAT, {"load1": 7.2, "process_cpu_frac": 0.3, "cpu_wait_frac": 0.7}, 1.35, "contention", "cpu_wait"),
        # the same host, the run's CPU share held: its steps do more work (a regression, on a busy host)
        (SAT, {"load1": 6.6, "process_cpu_frac": 0.4, "cpu_wait_frac": 0.6}, 2.0, "run", None),
        # its share fell, but not into waiting: it sleeps (a loop of its own making)
        (
            {"load1": 1.0, "process_cpu_frac": 0.95, "cpu_wait_frac": 0.02},
            {"load1": 1.0, "process_cpu_frac": 0.45, "cpu_wait_frac": 0.01},
            2.0,
            "run",
            None,
        ),
        # the saturated host explains a part (x1.25) but leaves x1.6 unexplained: its cause is unknown, not
        # the run's (issue 37: CPU wait on a saturated host was blamed on the run 7 times in 19)
        (SAT, {"load1": 7.0, "process_cpu_frac": 0.32, "cpu_wait_frac": 0.68}, 2.0, "unknown", "cpu_wait"),
        # the hypervisor took half the CPUs
        ({"steal_frac": 0.0}, {"steal_frac": 0.5}, 1.9, "contention", "steal"),
        # only the load is known: the fair share of 2 CPUs at a load of 6.5, then 9.0
        ({"load1": 6.5}, {"load1": 9.0}, 1.4, "contention", "load"),
        ({"load1": 6.5}, {"load1": 6.6}, 1.4, "run", "load"),  # x1.02 of x1.4: less than half the rise
    ],
)
def test_contention_rule(before, after, slowdown, cause, by):
    verdict = contention(_tracker(before, after).evidence(100), slowdown, 0.3)
    assert verdict["cause"] == cause
    assert (max(verdict["factors"], key=verdict["factors"].get) if verdict["factors"] else None) == by
    assert verdict["slowdown"] == slowdown and verdict["explained"] >= 1


def test_no_contention_verdict_without_both_sides():
    assert contention(None, 2.0, 0.3) is None
    t = HostLoadTracker()
    t.observe(_hb(50, load1=6.0, cpus=2))
    assert contention(t.evidence(100), 2.0, 0.3) is None  # nothing since the onset


def test_a_host_saturated_on_both_sides_is_never_called_calm():
    ev = _tracker({"load1": 6.5}, {"load1": 7.2}).evidence(100)
    assert ev["busier"] is False and ev["saturated"] == {"before": True, "now": True}
    assert (
        describe(ev) == "; host load unchanged, saturated throughout (6.5 → 7.2 on 2 CPUs, 3.2 → 3.6 per CPU)"
    )


def test_now_is_the_heartbeats_since_the_recent_level_began():
    """A finding judged on its latest steps (a creep, a long slowdown) compares the host then, not the
    median of every heartbeat since the onset."""
    t = HostLoadTracker()
    for step, load in [
        (80, 1.0),
        (90, 1.0),
        (100, 1.0),
        (110, 4.0),
        (120, 4.0),
        (130, 4.0),
        (140, 1.2),
        (150, 1.2),
    ]:
        t.observe(_hb(step, load1=load, cpus=2, cpu_wait_frac=load / 10))
    assert t.evidence(95)["now"]["cpu_wait_frac"] == pytest.approx(0.26)  # the median of all 6 since step 95
    recent = t.evidence(95, recent_step=135)["now"]
    assert recent["cpu_wait_frac"] == pytest.approx(0.12) and recent["first_step"] == 140
    assert t.evidence(95, recent_step=151)["now"]["first_step"] == 150  # none since: the latest


def test_annotate_keeps_the_finding_and_adds_the_evidence():
    from runwatch.detectors.findings import Finding

    finding = Finding(
        detector="throughput_drift",
        metric="step_time_s",
        step=120,
        severity="warning",
        message="step time rose",
        evidence={"onset_step": 100},
    )
    assert annotate(HostLoadTracker(), finding) is finding  # no heartbeat with host_load: unchanged
    out = annotate(_tracker({"load1": 1.0}, {"load1": 3.4}), finding)
    assert out.message.startswith("step time rose; host busier") and out.evidence["onset_step"] == 100
    assert out.evidence["host_load"]["busier"] is True and (out.step, out.severity) == (120, "warning")


# -- the detectors ---------------------------------------------------------------------------------


def _run(detector, events):
    found = []
    for event in events:
        found.extend(detector.update(event, event.ts))
    return found


def _stream(
    seed: int, slow_from: int, *, contended: bool, data_wait: bool = False, n: int = 1200
) -> Iterator[StepEvent | HeartbeatEvent]:
    """0.25 s steps slowing 2x at ``slow_from`` (or, ``data_wait``, a loader wait of 0.2 s from there);
    a heartbeat every 10 steps whose host either gets contended at the same step or stays calm."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        slow = i >= slow_from
        t = 0.25 * math.exp(rng.normal(0, 0.05))
        wait = 0.005
        if slow and data_wait:
            wait += 0.2
        elif slow:
            t *= 2
        yield StepEvent(run_id="r", step=i, ts=_ts(i), step_time_s=t + wait, data_wait_s=wait)
        if i % 10 == 0:
            busy = slow and contended
            yield HeartbeatEvent(
                run_id="r",
                step=i,
                ts=_ts(i + 0.5),
                host_load=HostLoad(
                    load1=(3.5 if busy else 1.0) + rng.uniform(0, 0.1),
                    cpus=2,
                    steal_frac=0.01,
                    # (busy: the run gets under half the CPU it had, the rest of the time it waits for one;
                    # slow and not busy: it sleeps half the time, as a loop of its own making would)
                    process_cpu_frac=(0.45 if busy else 0.95) if not slow or busy else 0.5,
                    cpu_wait_frac=(0.7 if busy else 0.02) + rng.uniform(0, 0.01),
                ),
            )


@pytest.mark.parametrize("contended", [True, False])
def test_throughput_finding_says_whether_the_host_got_busier(contended):
    (finding,) = _run(ThroughputDetector(ThroughputConfig()), _stream(1, 600, contended=contended))
    host = finding.evidence["host_load"]
    assert host["busier"] is contended
    assert host["before"]["last_step"] < finding.evidence["onset_step"] <= host["now"]["first_step"]
    if contended:  # named as contention; an alert still, since the host was not saturated before it
        assert host["reasons"] == ["load", "cpu_wait"]
        assert finding.evidence["cause"] == "contention" and finding.severity == "warning"
        assert re.search(
            r"^contention: step time rose .*; host busier at the same step: load 1\.\d → 3\.\d on 2 CPUs, "
            r"this process waited for a CPU 2% → 7\d% of the time; the host explains x2\.\d\d of the "
            r"x\d\.\d\d: this process's CPU share 95% → 45%, the rest waiting for a CPU$",
            finding.message,
        ), finding.message
    else:  # the run's own: it lost CPU time to sleeping, not to waiting for a CPU
        assert host["reasons"] == []
        assert finding.evidence["cause"] == "run" and finding.severity == "warning"
        assert re.search(
            r"^step time rose .*; host load unchanged \(1\.\d → 1\.\d on 2 CPUs\)$", finding.message
        ), finding.message


@pytest.mark.parametrize("contended", [True, False])
def test_data_wait_finding_says_whether_the_host_got_busier(contended):
    (finding,) = _run(
        DataWaitDetector(DataWaitConfig()), _stream(2, 600, contended=contended, data_wait=True)
    )
    assert finding.evidence["host_load"]["busier"] is contended
    assert ("host busier" in finding.message) is contended


def test_a_finding_waits_for_a_heartbeat_since_its_onset():
    events = list(_stream(1, 600, contended=True))
    det = ThroughputDetector(ThroughputConfig())
    found_at = None
    for event in events:
        if _run(det, [event]):
            found_at = event
            break
    # found at the heartbeat of step 610 (its period, steps 601..610, is the slow steps'), not at the
    # step event that made it (about 605: the heartbeat of step 600 had measured only one slow step)
    assert isinstance(found_at, HeartbeatEvent) and found_at.step == 610


def test_a_held_finding_goes_out_without_a_verdict_when_no_heartbeat_comes():
    events = [
        e for e in _stream(1, 600, contended=True) if not (isinstance(e, HeartbeatEvent) and e.step >= 600)
    ]
    det = ThroughputDetector(ThroughputConfig())
    released = []
    for event in events:
        out = _run(det, [event])
        if out:
            released.append((event, out))
    event, (finding,) = released[0]
    # held up to 2.5 heartbeat periods (5 s by default when heartbeats do not say) of event time
    assert isinstance(event, StepEvent) and (event.ts - _ts(finding.step)).total_seconds() >= 12.5
    host = finding.evidence["host_load"]
    assert host["busier"] is None and host["now"] is None and "host" not in finding.message


def test_the_run_end_releases_held_findings():
    from runwatch.contract.schema import RunEndEvent, RunStartEvent
    from runwatch.detectors.engine.monitor import RunMonitor

    monitor = RunMonitor("r", RunwatchConfig())
    anomalies = monitor.observe(RunStartEvent(run_id="r", ts=_ts(-1))).anomalies
    events = [
        e
        for e in _stream(1, 600, contended=True, n=610)
        if not (isinstance(e, HeartbeatEvent) and e.step >= 600)
    ]
    for event in events:
        anomalies += monitor.observe(event).anomalies
    assert not [
        a for a in anomalies if a.detector == "throughput_drift"
    ]  # held: no heartbeat since the onset
    end = RunEndEvent(run_id="r", ts=_ts(611))
    (anomaly,) = [a for a in monitor.observe(end).anomalies if a.detector == "throughput_drift"]
    assert anomaly.ts == end.ts and anomaly.evidence["host_load"]["busier"] is None
    assert (
        replay([RunStartEvent(run_id="r", ts=_ts(-1)), *events, end]).anomalies[-1].anomaly_id
        == anomaly.anomaly_id
    )


def test_without_host_load_on_heartbeats_nothing_is_held_or_added():
    plain = [
        e.model_copy(update={"host_load": None}) if isinstance(e, HeartbeatEvent) else e
        for e in _stream(1, 600, contended=True)
    ]
    (finding,) = _run(ThroughputDetector(ThroughputConfig()), plain)
    assert "host_load" not in finding.evidence and finding.step < 610


def test_host_load_state_pickles_with_the_detector():
    events = list(_stream(3, 600, contended=True))
    cut = next(i for i, e in enumerate(events) if isinstance(e, StepEvent) and e.step == 608)
    det = ThroughputDetector(ThroughputConfig())
    assert _run(det, events[:cut]) == []
    assert det.host_load.holding == 1  # a finding waits for its heartbeat: it pickles too
    clone = pickle.loads(pickle.dumps(det))
    rest = _run(det, events[cut:])
    assert len(rest) == 1 and _run(clone, events[cut:]) == rest


# -- detected_at -----------------------------------------------------------------------------------


def _nan_steps(run_id: str) -> list[StepEvent]:
    return [StepEvent(run_id=run_id, step=i, ts=_ts(i), loss=math.nan if i >= 8 else 1.0) for i in range(12)]


def test_the_worker_stamps_detected_at_with_its_clock_and_the_monitor_does_not():
    wall = T0 + timedelta(days=1)  # after the events, as a worker reading a backlog is
    proc = TelemetryProcessor(RunwatchConfig(), SEED, clock=lambda: wall)
    events, online = _nan_steps("r1"), []
    for e in events:
        online.extend(proc.process(e.to_json(), key=b"r1").anomalies)
    offline = replay(events).anomalies
    assert online and [a.anomaly_id for a in online] == [a.anomaly_id for a in offline]  # ids unchanged
    assert all(a.detected_at == wall for a in online)
    assert all(a.detected_at is None for a in offline)  # replay has no clock: left unset
    assert [a.model_dump_json(exclude={"detected_at"}) for a in online] == [
        a.model_dump_json(exclude={"detected_at"}) for a in offline
    ]  # (NaN values: compared as JSON)


def test_a_saturated_host_that_explains_part_of_a_slowdown_leaves_its_cause_unknown_not_the_run():
    """Issue 37: on a saturated host whose only evidence is CPU wait, not enough to explain all of the
    slowdown, the cause is "unknown (host saturated)", never the run's."""
    from runwatch.detectors.host_load import contention

    before = {"load1": 4.0, "cpus": 2, "process_cpu_frac": 0.6, "cpu_wait_frac": 0.5}
    now = {"load1": 4.2, "cpus": 2, "process_cpu_frac": 0.45, "cpu_wait_frac": 0.7}  # x1.33 of CPU lost
    verdict = contention({"before": before, "now": now}, slowdown=2.0, tolerance=0.3)
    assert verdict is not None and verdict["cause"] == "unknown" and verdict["saturated_now"]
    calm = {"load1": 0.5, "cpus": 2, "process_cpu_frac": 0.95, "cpu_wait_frac": 0.02}
    quiet = {"load1": 0.6, "cpus": 2, "process_cpu_frac": 0.5, "cpu_wait_frac": 0.03}  # it sleeps: its own
    assert contention({"before": calm, "now": quiet}, slowdown=2.0, tolerance=0.3)["cause"] == "run"
