"""JsonlRecorder: the same events as RunWatch, as JSONL lines, on an injectable (simulated) clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import torch
from torch import nn

from runwatch.contract.schema import decode_event
from runwatch.producer.instrument.watch import Watcher
from runwatch.producer.publish.recorder import JsonlRecorder

T0 = datetime(2025, 1, 1, tzinfo=UTC)


class SimClock:
    def __init__(self):
        self.t = 0.0

    def seconds(self) -> float:
        return self.t

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.t)


def read(path):
    return [decode_event(line) for line in path.read_bytes().splitlines()]


def test_events_are_written_in_order_with_the_clock_and_a_run_end(tmp_path):
    sim = SimClock()
    rec = JsonlRecorder(
        tmp_path / "run.jsonl",
        "rec-run",
        clock=sim.now,
        collect_metadata=False,
        tags={"scenario": "x"},
        run_start={"seed": 3},
    )
    sim.t = 1.5
    assert rec.step(0, loss=float("nan"), lr=[1e-3])
    sim.t = 2.0
    rec.heartbeat(0, "checkpoint", 0.5)
    ref = rec.checkpoint(0, "mem://ckpt-0")
    rec.eval(0, "val", 0.25, metrics={"accuracy": 0.5})
    assert rec.close(status="stopped", summary={"steps": 1}) == 6
    assert not rec.step(1, loss=1.0)  # closed: nothing more is written
    events = read(tmp_path / "run.jsonl")
    assert [e.kind for e in events] == ["run_start", "step", "heartbeat", "checkpoint", "eval", "run_end"]
    assert {e.run_id for e in events} == {"rec-run"}
    assert [e.ts for e in events] == [T0, *[T0 + timedelta(seconds=s) for s in (1.5, 2.0, 2.0, 2.0, 2.0)]]
    assert events[0].seed == 3 and events[0].tags == {"scenario": "x"} and events[0].git_sha is None
    assert events[1].loss != events[1].loss  # NaN survives the file
    assert events[2].phase == "checkpoint" and events[2].time_in_phase_s == 0.5
    assert rec.checkpoints == [ref] and events[3].uri == "mem://ckpt-0"
    assert events[5].status == "stopped" and events[5].summary == {"steps": 1}


def test_an_invalid_event_is_counted_not_raised(tmp_path):
    rec = JsonlRecorder(tmp_path / "r.jsonl", "bad", rank=1, collect_metadata=False)
    assert not rec.step(-1, loss=1.0)
    assert rec.invalid == 1
    rec.close()
    assert (tmp_path / "r.jsonl").read_bytes() == b""  # rank 1: no run_start/run_end, nothing valid


def test_the_watcher_on_a_simulated_clock_times_steps_waits_and_phases_by_that_clock(tmp_path):
    sim = SimClock()
    rec = JsonlRecorder(tmp_path / "w.jsonl", "sim", clock=sim.now, collect_metadata=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = rec.watch(model, opt, clip=1.0, update_every=1, heartbeat_s=5.0, clock=sim.seconds, memory=False)
    assert isinstance(watch, Watcher) and not watch.heartbeat.running  # the caller beats

    def loader():
        for _ in range(3):
            sim.t += 0.25  # the loader makes us wait a quarter second per batch
            watch.heartbeat.beat()
            yield torch.randn(8, 4)

    for i, x in enumerate(watch.data(loader())):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sim.t += 1.0  # compute
        watch.end_step(loss, samples=8)
        if i == 0:
            with watch.phase("checkpoint"):
                sim.t += 30.0  # a long save: not step time
                watch.heartbeat.beat()
    watch.close()
    rec.close()
    events = read(tmp_path / "w.jsonl")
    steps = [e for e in events if e.kind == "step"]
    assert [e.step for e in steps] == [0, 1, 2]
    for e in steps:
        assert abs(e.step_time_s - 1.25) < 1e-9 and abs(e.data_wait_s - 0.25) < 1e-9
        assert abs(e.samples_per_s - 8 / 1.25) < 1e-9
        assert e.relative_update_norm is not None
    beats = [(e.step, e.phase, e.time_in_phase_s) for e in events if e.kind == "heartbeat"]
    assert beats[0] == (None, "dataload", 0.25)
    assert beats[1] == (0, "checkpoint", 30.0)
    assert beats[2] == (0, "dataload", 0.25)
    assert [e.ts for e in steps] == [T0 + timedelta(seconds=s) for s in (1.25, 32.5, 33.75)]
