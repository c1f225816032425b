"""The conformance suite every registered detector runs through (in the spirit of river's
``check_estimator``): a new detector gets these tests by being registered.

Each detector is driven as the monitor drives its view: a rank or joined-view detector on one
seeded single-rank stream that is healthy for 200 steps and then goes wrong in every way those
detectors look for (a loss spike that stays, one module's gradient, the update size, the step
time, the data wait, memory, one category, a NaN, modules frozen, the weights shrinking, one
category's eval loss, the gap of a second eval split to the train loss, the producer's mark of an
optimizer that no longer steps, one module's units dead; the validation loss worsens
earlier, from step 100; at the end the steps stop while the heartbeats go on: a stall); a
cross-rank detector on a seeded three-rank stream in lockstep (every rank's events, and each joined
step's record from a real ``StepJoin``) where one rank becomes a straggler at step 200 and another
hangs at the end,
its peers waiting for it in the gradient synchronisation:

- nothing during the warm-up (the first 20 steps);
- the same input gives the same findings;
- events of kinds it does not read (checkpoints, acks, run start) change nothing;
- its state pickles mid-stream and resumes with exactly the findings of an uninterrupted run;
- the stream's faults are found by the detectors that look for them (so the checks above compare
  something);
- a fault replayed after a rollback is found again. Step-indexed detectors: through the monitor,
  which rewinds them to the restored checkpoint. Liveness detectors (stall, hung rank) are about
  time, not steps, and are not rewound: the step going back is progress, which re-arms them, so a
  stall or a hang in the replay is found again. The straggler is about a rank's speed: the replay's
  healthy steps re-arm it, and the rank slowing down again is found again.
"""

from __future__ import annotations

import math
import pickle
import random
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import (
    ActionAckEvent,
    CategoryLoss,
    CheckpointEvent,
    DigestGroup,
    EvalEvent,
    GpuHealth,
    HeartbeatEvent,
    MemoryStats,
    ReplicaDigests,
    RunStartEvent,
    StackEvidenceEvent,
    StackFrame,
    StepEvent,
    ThreadStack,
)
from runwatch.detectors import registry
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor
from runwatch.detectors.engine.rank_join import StepJoin

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
ONSET = 200
STEPS = 320
SPECS = registry.specs()
MiB = 1 << 20
RANKS = 3  # the cross-rank stream's


def _digests(bad: bool) -> ReplicaDigests:
    if not bad:
        return ReplicaDigests(groups=[DigestGroup(digest="a" * 32, count=4, ranks=[0, 1, 2, 3])])
    return ReplicaDigests(
        groups=[
            DigestGroup(digest="a" * 32, count=3, ranks=[0, 1, 3]),
            DigestGroup(digest="b" * 32, count=1, ranks=[2]),
        ]
    )


def stream(seed: int = 0) -> list:
    """Healthy, then every fault at ONSET (the memory leak ramps from there); validation worsens
    from step 100 while the training loss still improves."""
    rng = random.Random(seed)
    events, t = [], T0
    for step in range(STEPS):
        bad = step >= ONSET
        noise = math.exp(rng.gauss(0, 0.05))
        step_time = (0.5 if bad else 0.25) * math.exp(rng.gauss(0, 0.02))
        data_wait = (0.2 if bad else 0.01) * math.exp(rng.gauss(0, 0.05))
        loss = 2.0 * math.exp(-step / 300) * noise * (4.0 if bad else 1.0)
        modules = {f"layer{i}": 0.3 * math.exp(rng.gauss(0, 0.05)) for i in range(4)}
        if bad:
            modules["layer2"] *= 40
            modules["layer3"] = 0.0  # frozen
        t += timedelta(seconds=step_time)
        events.append(
            StepEvent(
                run_id="conf",
                step=step,
                ts=t,
                event_id=f"s{step}",
                loss=math.nan if step == STEPS - 5 else loss,
                grad_norm=math.sqrt(sum(v * v for v in modules.values())),
                module_grad_norms=modules,
                # every 5th step the producer's activation samples: act1's units die at the onset
                module_activations=(
                    {
                        f"act{i}": {"rms": 0.5 * noise, "zero_frac": 0.95 if bad and i == 1 else 0.3}
                        for i in range(3)
                    }
                    if step % 5 == 0
                    else {}
                ),
                param_norm=50.0 * math.exp(-0.002 * max(0, step - ONSET)),  # weights shrinking
                # the producer says its optimizer no longer steps (replaced without rw.watch)
                instrumentation="optimizer_not_stepping" if step >= ONSET + 2 else None,
                update_norm=0.05 * (30 if bad else 1) * noise,
                relative_update_norm=1e-3 * (30 if bad else 1) * noise,
                lr=[1e-3],
                step_time_s=step_time,
                data_wait_s=data_wait,
                samples_per_s=64 / step_time,
                memory=MemoryStats(
                    allocated=(2000 + (step - ONSET) * 20 if bad else 2000) * MiB,
                    reserved=2200 * MiB,
                    device_total=8000 * MiB,
                ),
                category_loss={
                    "a": CategoryLoss(mean=loss, count=32),
                    "b": CategoryLoss(mean=loss * (1 + 0.05 * max(0, step - ONSET)), count=32),
                },
                # every 50th step the join's replica digests (4 replicas): rank 2's differ from the onset
                replicas=_digests(bad) if step % 50 == 0 else None,
            )
        )
        if step % 5 == 0:
            events.append(
                HeartbeatEvent(
                    run_id="conf", step=step, ts=t, event_id=f"h{step}", interval_s=1.25, gpu=gpu_health(0)
                )
            )
        if step % 20 == 19:
            val = 1.2 * (1 + 0.5 * max(0, step - 100) / 40)  # overfits from step 100
            cats = {c: {"loss": val * (1 + 0.1 * i), "count": 64.0} for i, c in enumerate("abcd")}
            if bad:
                cats["d"]["loss"] *= 2  # one category's eval loss doubles
            events.append(
                EvalEvent(run_id="conf", step=step, ts=t, event_id=f"e{step}", loss=val, per_category=cats)
            )
            # a second split a stable 30% above the healthy train loss, falling; from ONSET it leaks into
            # training: its loss falls 5x, under the train loss
            test = 1.3 * 2.0 * math.exp(-step / 300) * (0.2 if bad else 1.0)
            events.append(
                EvalEvent(run_id="conf", step=step, ts=t, event_id=f"t{step}", split="test", loss=test)
            )
    for beat in range(1, 25):  # the steps stop, the heartbeats go on: a stall
        ts = t + timedelta(seconds=1.25 * beat)
        events.append(
            HeartbeatEvent(run_id="conf", step=STEPS - 1, ts=ts, event_id=f"hs{beat}", interval_s=1.25)
        )
    return events


HANG = 280  # the cross-rank stream's last step: then rank 1 hangs


def gpu_health(rank: int, throttled: bool = False) -> GpuHealth:
    """A heartbeat's NVML figures (the producer's ``gpu``): full clocks, or (``throttled``) a thermal throttle
    capping the SM clock."""
    return GpuHealth(
        device=rank,
        util_pct=97,
        sm_clock_mhz=1110 if throttled else 1980,
        sm_clock_max_mhz=1980,
        throttle_reasons=["sw_thermal_slowdown"] if throttled else [],
        temperature_c=88 if throttled else 65,
        power_w=300.0,
        power_limit_w=400.0,
    )


def multi_rank_stream(seed: int = 0) -> list:
    """Three ranks in lockstep (every step time the same), healthy; from ONSET rank 2 computes 3x
    longer (a straggler: its ``compute_s`` is its own), and after step HANG rank 1 stops while every
    rank beats on, ranks 0 and 2 waiting for it in the gradient synchronisation."""
    rng = random.Random(seed)
    events, t = [RunStartEvent(run_id="conf", ts=T0, world_size=RANKS, event_id="start")], T0
    for step in range(HANG + 1):
        t += timedelta(seconds=0.25 * math.exp(rng.gauss(0, 0.02)))
        for rank in range(RANKS):
            compute = 0.1 * math.exp(rng.gauss(0, 0.05)) * (3 if rank == 2 and step >= ONSET else 1)
            events.append(
                StepEvent(
                    run_id="conf",
                    rank=rank,
                    step=step,
                    ts=t + timedelta(milliseconds=rank),
                    event_id=f"s{step}r{rank}",
                    loss=1.0,
                    step_time_s=0.25,
                    compute_s=compute,
                )
            )
            if step % 5 == 0:
                events.append(
                    HeartbeatEvent(
                        run_id="conf",
                        rank=rank,
                        step=step,
                        ts=t + timedelta(milliseconds=rank),
                        event_id=f"h{step}r{rank}",
                        interval_s=1.25,
                        gpu=gpu_health(rank, throttled=rank == 2 and step >= ONSET),
                    )
                )
    for beat in range(1, 25):
        for rank in range(RANKS):
            events.append(
                HeartbeatEvent(
                    run_id="conf",
                    rank=rank,
                    step=HANG,
                    ts=t + timedelta(seconds=1.25 * beat),
                    event_id=f"hh{beat}r{rank}",
                    interval_s=1.25,
                    in_sync=rank != 1,
                    gpu=gpu_health(rank, throttled=rank == 2),
                )
            )
            if beat == 4:  # the stacks each rank's heartbeat thread sends once its step stopped (5 s)
                events.append(hang_evidence(rank, t + timedelta(seconds=1.25 * beat), rank == 1))
    return events


def hang_evidence(rank: int, ts, culprit: bool) -> StackEvidenceEvent:
    inner = (
        StackFrame(file="/app/train.py", line=151, function="train_step", code="time.sleep(600)")
        if culprit
        else StackFrame(
            file="/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
            line=3252,
            function="all_reduce",
        )
    )
    main = ThreadStack(
        name="MainThread",
        thread_id=1,
        training=True,
        frames=[StackFrame(file="/app/train.py", line=210, function="<module>"), inner],
    )
    return StackEvidenceEvent(
        run_id="conf",
        rank=rank,
        step=HANG,
        ts=ts,
        event_id=f"ev{rank}",
        seconds_since_step=5.0,
        threads=[main],
    )


# Detectors that read checkpoint events: memory_growth sets aside the memory a checkpoint's step rises by
# (the phase's, not the training steps').
READS_CHECKPOINTS = {"memory_growth"}


def noise_events(event, spec) -> list:
    """Events of kinds ``spec``'s detector does not read, from the same rank at the same time."""
    ack = ActionAckEvent(run_id="conf", rank=event.rank, action_id="x", outcome="applied", ts=event.ts)
    if spec.name in READS_CHECKPOINTS:
        return [ack]
    step = getattr(event, "step", 0) or 0
    return [CheckpointEvent(run_id="conf", rank=event.rank, step=step, uri="/c", ts=event.ts), ack]


class Feed:
    """Drives one detector as the monitor drives its view: a cross-rank detector also gets each
    joined step's record, after the rank step event that completed it."""

    def __init__(self, spec: registry.DetectorSpec):
        self.join: StepJoin | None = None
        if spec.view == "cross_rank":
            self.join = StepJoin("conf")
            self.join.set_world_size(RANKS)

    def run(self, detector, events) -> list:
        findings = []
        for event in events:
            findings += detector.update(event, event.ts)
            if self.join is not None and isinstance(event, StepEvent):
                for joined in self.join.add(event):
                    findings += detector.update(joined.record, joined.event.ts)
            findings += detector.tick(event.ts)
        return findings


def run(spec, events) -> list:
    """A fresh detector of ``spec`` over ``events``."""
    return Feed(spec).run(build(spec), events)


def build(spec):
    return spec.build(RunwatchConfig().detectors)


EVENTS = stream()
MULTI_RANK = multi_rank_stream()


def events_for(spec) -> list:
    return MULTI_RANK if spec.view == "cross_rank" else EVENTS


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_nothing_during_warm_up_and_the_same_input_gives_the_same_findings(spec):
    events = events_for(spec)
    warm = [e for e in events if getattr(e, "step", 0) is not None and (getattr(e, "step", 0) or 0) < 20]
    assert run(spec, warm) == []
    assert run(spec, events) == run(spec, events)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_events_of_kinds_it_does_not_read_change_nothing(spec):
    events = [e for e in events_for(spec) if not isinstance(e, RunStartEvent)]
    start = RunStartEvent(
        run_id="conf", ts=T0, event_id="start", world_size=RANKS if spec.view == "cross_rank" else 1
    )
    mixed = [start] + [x for e in events for x in (e, *noise_events(e, spec))]
    assert run(spec, mixed) == run(spec, events)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_state_pickles_mid_stream_and_resumes_with_the_same_findings(spec):
    events = events_for(spec)
    whole = run(spec, events)
    cut = len(events) * 3 // 4  # inside the faulty part: open episodes, cooldowns, watches
    feed, first = Feed(spec), build(spec)
    before = feed.run(first, events[:cut])
    resumed = pickle.loads(pickle.dumps(first))
    assert before + feed.run(resumed, events[cut:]) == whole


EXPECTED = {
    "non_finite",
    "loss_spike",
    "loss_rise",
    "module_grad_explosion",
    "update_ratio",
    "throughput_drift",
    "data_wait",
    "memory_growth",
    "category_divergence",
    "val_vs_train",
    "frozen_modules",
    "param_norm_drift",
    "eval_category_divergence",
    "val_train_gap",
    "optimizer_swap",
    "activations",
    "stall",
    "straggler",
    "hung_rank",
    "replica_divergence",
}


def test_the_stream_faults_are_found_so_the_checks_compare_something():
    found = {spec.name for spec in SPECS if run(spec, events_for(spec))}
    assert EXPECTED <= found, EXPECTED - found


LAST = 300  # before the NaN near the end


def replayed_stream() -> list:
    """The faulty stream to step LAST with a checkpoint at step 150, then the trainer's ack of a
    rollback to it and the same steps again (the fault comes back at ONSET), with time going on."""
    first = [e for e in EVENTS if (getattr(e, "step", 0) or 0) <= LAST]
    at = next(i for i, e in enumerate(first) if isinstance(e, StepEvent) and e.step == 150)
    first.insert(
        at + 1, CheckpointEvent(run_id="conf", step=150, uri="/c/150", ts=first[at].ts, event_id="c150")
    )
    again = [e for e in EVENTS if 150 < (getattr(e, "step", 0) or 0) <= LAST]
    shift = first[-1].ts - again[0].ts + timedelta(seconds=1)
    ack = ActionAckEvent(
        run_id="conf",
        action_id="rb-1",
        action_kind="rollback",
        outcome="applied",
        to_step=150,
        ts=first[-1].ts,
        event_id="ack",
    )
    return (
        first
        + [ack]
        + [e.model_copy(update={"ts": e.ts + shift, "event_id": f"r{e.event_id}"}) for e in again]
    )


REPLAYED = replayed_stream()
ACK = next(i for i, e in enumerate(REPLAYED) if e.event_id == "ack")


STEP_INDEXED = [
    s
    for s in SPECS
    if s.name in EXPECTED - {"val_vs_train", "non_finite", "eval_category_divergence", "val_train_gap"}
    and not s.episodic
    and s.view != "cross_rank"
]


@pytest.mark.parametrize("spec", STEP_INDEXED, ids=lambda s: s.name)
def test_a_fault_replayed_after_a_rollback_is_found_again_and_said_once(spec):
    """Through the monitor, which rewinds the detectors to the restored checkpoint (rewind.py): a
    long fault seen before the rollback must not hide its replay: the rewound detector finds it again,
    the same finding at the same step. The monitor does not issue it twice (one finding per onset across
    rollbacks); it keeps it in ``repeated``."""
    monitor = RunMonitor("conf", RunwatchConfig.model_validate({"policy": {"alert_only": True}}))

    def observe(events):
        outs = [monitor.observe(e) for e in events]
        issued = [a for out in outs for a in out.anomalies if a.detector == spec.name]
        repeated = [f for out in outs for f in out.repeated if f.detector == spec.name]
        return issued, repeated

    first, _ = observe(REPLAYED[:ACK])
    assert [a for a in first if a.step >= ONSET], "found the first time"
    issued, again = observe(REPLAYED[ACK:])
    assert again, spec.name
    assert [(f.step, f.message) for f in again if f.step >= ONSET] == [
        (a.step, a.message) for a in first if a.step >= ONSET
    ][: len(again)]
    assert [(a.step, a.message) for a in issued if a.step >= ONSET] == []


def test_a_detector_whose_state_does_not_pickle_costs_its_rewind_not_the_run():
    monitor = RunMonitor("conf", RunwatchConfig())
    monitor.joined_detectors.append(
        type(
            "Local", (), {"name": "local", "update": lambda *a: [], "tick": lambda *a: [], "f": lambda: None}
        )()
    )
    for event in REPLAYED[:ACK]:
        monitor.observe(event)
    assert monitor.snapshots.unpicklable == 1 and monitor.snapshots.steps == []


def rolled_back(events: list, to_step: int, replay_from: int) -> list:
    """``events``, then every rank's ack of a rollback to ``to_step`` and the events from step
    ``replay_from`` on (``step`` of a heartbeat included) again, with time going on."""
    again = [
        e
        for e in events
        if (getattr(e, "step", None) or 0) > replay_from and not isinstance(e, RunStartEvent)
    ]
    shift = events[-1].ts - again[0].ts + timedelta(seconds=1)
    ranks = sorted({e.rank for e in events})
    acks = [
        ActionAckEvent(
            run_id="conf",
            rank=r,
            action_id="rb-1",
            action_kind="rollback",
            outcome="applied",
            to_step=to_step,
            ts=events[-1].ts,
            event_id=f"ack{r}",
        )
        for r in ranks
    ]
    return (
        events
        + acks
        + [e.model_copy(update={"ts": e.ts + shift, "event_id": f"r{e.event_id}"}) for e in again]
    )


def monitor_findings(events: list, detector: str) -> list:
    """The anomalies of ``detector`` when a monitor observes ``events`` and ticks at each."""
    monitor = RunMonitor("conf", RunwatchConfig.model_validate({"policy": {"alert_only": True}}))
    found = []
    for event in events:
        found += monitor.observe(event).anomalies + monitor.tick(event.ts).anomalies
    return [a for a in found if a.detector == detector]


@pytest.mark.parametrize(
    ("name", "events"), [("stall", EVENTS), ("hung_rank", MULTI_RANK)], ids=["stall", "hung_rank"]
)
def test_a_stall_or_hang_replayed_after_a_rollback_is_found_again(name, events):
    """Liveness detectors are not rewound: the step going back is progress, which re-arms them."""
    once = monitor_findings(events, name)
    twice = monitor_findings(rolled_back(events, to_step=150, replay_from=150), name)
    assert (
        once
        and [(a.rank, a.step, a.evidence["kind"]) for a in twice]
        == [(a.rank, a.step, a.evidence["kind"]) for a in once] * 2
    )


def test_a_straggler_replayed_after_a_rollback_is_found_again():
    """The straggler is about a rank's speed, not its steps: the replay's healthy steps (before
    ONSET) re-arm it, and the rank slowing down again is found again."""
    events = [
        e for e in MULTI_RANK if (getattr(e, "step", None) or 0) <= 260 and not getattr(e, "in_sync", None)
    ]
    once = monitor_findings(events, "straggler")
    twice = monitor_findings(rolled_back(events, to_step=150, replay_from=150), "straggler")
    assert [a.rank for a in once] == [2] and [a.rank for a in twice] == [2, 2]
    assert twice[0] == once[0] and twice[1].step >= ONSET
