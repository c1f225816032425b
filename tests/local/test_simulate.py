"""``runwatch simulate``'s synthetic run (local/runwatch/local/simulate.py): every event it makes is valid
wire JSON, and each fault shows where it was asked for."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from runwatch.contract.schema import decode_event
from runwatch.local.simulate import Fault, SyntheticRun, parse_fault

T = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def decoded(pairs):
    return [(rank, decode_event(raw, received_at=T, key=b"sim")) for rank, raw in pairs]


def test_every_event_is_valid_wire_json_and_names_its_rank():
    run = SyntheticRun("sim", 8, faults=[Fault("memory", 3, 100)])
    start = decode_event(run.run_start(T), received_at=T, key=b"sim")
    assert start.kind == "run_start" and start.world_size == 8
    steps = decoded(run.step(5, T))
    assert [rank for rank, _ in steps] == list(range(8))
    assert all(e.rank == r and e.step == 5 and math.isfinite(e.loss) for r, e in steps)
    assert len({e.event_id for _, e in steps}) == 8  # (the worker drops a repeated event id)
    assert steps[3][1].memory.allocated - steps[0][1].memory.allocated == 500 * 2**20
    beats = decoded(run.heartbeats(5, T, 5.0))
    assert [e.kind for _, e in beats] == ["heartbeat"] * 8 and not any(e.in_sync for _, e in beats)


def test_a_hang_stops_the_whole_job_and_only_the_hung_rank_is_out_of_sync():
    run = SyntheticRun("sim", 4, faults=[Fault("hang", 2, 10)])
    assert len(list(run.step(9, T))) == 4
    assert list(run.step(10, T)) == [] and list(run.step(11, T)) == []
    beats = {r: e for r, e in decoded(run.heartbeats(9, T, 5.0))}
    assert [beats[r].in_sync for r in range(4)] == [True, True, False, True]


def test_nan_spike_and_slow_faults_show_on_their_rank_only():
    run = SyntheticRun("sim", 4, faults=[Fault("nan", 1, 3), Fault("spike", 2, 4), Fault("slow", 3, 1.5)])
    at3 = dict(decoded(run.step(3, T)))
    assert math.isnan(at3[1].loss) and math.isnan(at3[1].grad_norm) and math.isfinite(at3[0].loss)
    at4 = dict(decoded(run.step(4, T)))
    assert at4[2].loss > 10 * at4[0].loss
    assert at4[3].compute_s > 1.4 * at4[0].compute_s
    assert all(abs(e.step_time_s - at4[0].step_time_s) < 0.1 for e in at4.values())  # (synchronous)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hang:2", "KIND:RANK:ARG"),
        ("melt:1:2", "KIND:RANK:ARG"),
        ("hang:x:2", "integer"),
        ("hang:9:2", "not one of the run's ranks"),
        ("slow:1:0.5", "slow factor"),
        ("nan:1:inf", "finite"),
    ],
)
def test_a_bad_fault_says_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        parse_fault(text, ranks=4)
    assert parse_fault("slow:3:1.5", ranks=4) == Fault("slow", 3, 1.5)
