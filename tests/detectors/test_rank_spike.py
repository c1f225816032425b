"""Issue 38, item 2: a finite spike of one rank is judged on that rank, named, and rolled back for the run;
a spike every rank shares stays the joined step's, and healthy ranks that differ steadily stay quiet."""

from __future__ import annotations

import pickle
import random
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import CheckpointEvent, RunStartEvent, StepEvent
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.engine.step_partial import merge, partial_of, rank_extremes

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "run-rank-spike"
WORLD = 4


def _step(rank: int, n: int, loss: float, grad_norm: float = 1.0) -> StepEvent:
    return StepEvent(
        run_id=RUN, rank=rank, step=n, ts=T0 + timedelta(seconds=n), loss=loss, grad_norm=grad_norm
    )


def _losses(n: int, rng: random.Random) -> list[float]:
    """Four ranks on their own data: a falling loss, each rank a steady few % off the others, plus noise."""
    base = 2.0 * 0.995**n
    return [base * (1 + 0.05 * rank) * rng.lognormvariate(0, 0.08) for rank in range(WORLD)]


def _run(spike=None, everyone=None, steps: int = 120):
    """Feed the monitor ``steps`` steps of WORLD ranks; ``spike`` = (rank, first step, steps, factor) on one
    rank's loss, ``everyone`` = (first step, steps, factor) on every rank's. Checkpoints every 10 steps."""
    rng = random.Random(7)
    monitor = RunMonitor(RUN, RunwatchConfig())
    monitor.observe(RunStartEvent(run_id=RUN, world_size=WORLD, ts=T0))
    anomalies, decisions = [], []
    for n in range(steps):
        losses = _losses(n, rng)
        if spike is not None and spike[1] <= n < spike[1] + spike[2]:
            losses[spike[0]] *= spike[3]
        if everyone is not None and everyone[0] <= n < everyone[0] + everyone[1]:
            losses = [x * everyone[2] for x in losses]
        for rank in range(WORLD):
            out = monitor.observe(_step(rank, n, losses[rank]))
            anomalies += out.anomalies
            decisions += out.decisions
        if n % 10 == 0 and n:
            ts = T0 + timedelta(seconds=n, milliseconds=500)
            out = monitor.observe(CheckpointEvent(run_id=RUN, step=n, uri=f"/ckpt/{n}", ts=ts))
            decisions += out.decisions
    return anomalies, decisions


def test_a_20x_loss_on_one_rank_for_6_steps_is_named_and_rolled_back_for_the_run():
    anomalies, decisions = _run(spike=(3, 80, 6, 20.0))
    spikes = [a for a in anomalies if a.detector == "loss_spike" and a.severity != "info"]
    assert spikes, anomalies
    # the joined mean's spike at the first step (5.75x) says which rank stands out in it...
    joined = [a for a in spikes if a.evidence.get("kind") == "spike"]
    assert [(a.step, a.rank, a.evidence["largest_rank"]) for a in joined] == [(80, None, 3)]
    assert "largest on rank 3" in joined[0].message
    # ... and two steps in a row on rank 3 are rank 3's: found at the second, its onset the first
    (first,) = [a for a in spikes if a.evidence.get("kind") == "rank_spike"]
    assert first.step == 81 and first.onset_step == 80 and first.rank == 3
    assert first.evidence["rank"] == 3 and first.evidence["steps"] == 2
    assert "rank 3" in first.message and first.severity == "critical"
    rollbacks = [d for d in decisions if d.kind == "rollback"]
    assert len(rollbacks) == 1, decisions  # one action for the run: every rank's listener applies it
    target = rollbacks[0].target_checkpoint
    assert target is not None and target.step < 80 and "rank 3" in rollbacks[0].reason
    assert rollbacks[0].anomaly_ids == [first.anomaly_id]


def test_one_rank_of_64_is_found_though_the_joined_mean_barely_moves():
    # the mean of 64 ranks moves by 30% when one is at 20x: under the joined test's 2x, found by the rank's
    rng = random.Random(3)
    events = [StepEvent(run_id=RUN, rank=r, step=0, ts=T0, loss=rng.uniform(1.9, 2.1)) for r in range(64)]
    events[17] = events[17].model_copy(update={"loss": 40.0})
    extremes = rank_extremes(partial_of((0, 0), events, 64, []))
    assert extremes["loss"].rank == 17 and 18 < extremes["loss"].value / extremes["loss"].others < 22


def test_one_ranks_one_step_outlier_is_chance_not_a_finding():
    # a single step of one rank at 20x (what tiny per-rank batches near zero loss give by chance)
    anomalies, decisions = _run(spike=(2, 80, 1, 20.0))
    assert [a for a in anomalies if a.evidence.get("kind") == "rank_spike"] == []


def test_healthy_ranks_that_differ_steadily_raise_nothing():
    anomalies, decisions = _run()
    assert [a for a in anomalies if a.severity != "info"] == []
    assert decisions == []


def test_a_spike_every_rank_shares_is_the_joined_steps_and_names_no_rank():
    anomalies, _ = _run(everyone=(80, 1, 20.0))
    spikes = [a for a in anomalies if a.detector == "loss_spike"]
    assert spikes and spikes[0].step == 80 and spikes[0].rank is None
    assert all(a.evidence.get("kind") not in ("rank_spike", "rank_divergence") for a in spikes)


def test_rank_extremes_merge_across_groups_as_over_the_whole_run():
    rng = random.Random(11)
    events = [
        StepEvent(run_id=RUN, rank=r, step=5, ts=T0, loss=rng.uniform(1, 2), grad_norm=rng.uniform(1, 3))
        for r in range(8)
    ]
    whole = rank_extremes(partial_of((0, 5), events, 8, []))
    halves = merge([partial_of((0, 5), events[:4], 4, []), partial_of((0, 5), events[4:], 4, [])], 8)
    merged = rank_extremes(halves)
    for metric in ("loss", "grad_norm"):
        assert merged[metric].rank == whole[metric].rank
        assert abs(merged[metric].others - whole[metric].others) < 1e-9
        assert merged[metric].ranks == 8


def test_sharded_norms_and_a_single_rank_have_no_rank_extreme_for_the_norm():
    events = [
        StepEvent(run_id=RUN, rank=r, step=1, ts=T0, loss=1.0, grad_norm=2.0, grad_sharded=True)
        for r in range(3)
    ]
    assert "grad_norm" not in rank_extremes(partial_of((0, 1), events, 3, []))
    assert rank_extremes(partial_of((0, 1), events[:1], 1, [])) == {}


def test_the_spike_detector_with_its_rank_test_pickles():
    monitor = RunMonitor(RUN, RunwatchConfig())
    monitor.observe(RunStartEvent(run_id=RUN, world_size=2, ts=T0))
    for n in range(30):
        for rank in range(2):
            monitor.observe(_step(rank, n, 1.0 + 0.1 * rank))
    restored = pickle.loads(pickle.dumps(monitor))
    assert restored is not None
