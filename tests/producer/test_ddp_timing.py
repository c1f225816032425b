"""DDP section timing with real multi-process DDP (gloo, CPU, 3 ranks): a rank that is slow before
its forward shows in compute_s while step time is the same on every rank (the fast ranks wait
inside backward), and a heartbeat taken while it is slow says in_sync on the ranks that wait and
not on the slow one. The comm hook leaves the gradients as DDP computes them, and a model that
already has a comm hook trains on without timing."""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from runwatch.contract.schema import HeartbeatEvent, StepEvent
from runwatch.producer.instrument.watch import Watcher

pytestmark = pytest.mark.integration  # starts processes (issue 25: not in `make test-fast`)

WORLD = 3
SLOW_RANK = 2
SLOW_S = 0.15
STEPS = 12


class Recorder:
    """Stands in for RunWatch: validates and keeps step events, stamps heartbeats with the
    (system-wide, monotonic) perf_counter so ranks' timelines can be compared."""

    def __init__(self, rank: int):
        self.rank = rank
        self.steps: list[StepEvent] = []
        self.heartbeats: list[tuple[float, int | None, bool | None]] = []

    def step(self, step: int, **fields) -> bool:
        self.steps.append(StepEvent(run_id="ddp", rank=self.rank, step=step, **fields))
        return True

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, in_sync=None, interval_s=None) -> bool:
        event = HeartbeatEvent(
            run_id="ddp",
            rank=self.rank,
            step=step,
            phase=phase,
            time_in_phase_s=time_in_phase_s,
            in_sync=in_sync,
        )
        self.heartbeats.append((time.perf_counter(), event.step, event.in_sync))
        return True


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    ddp = DDP(model(), bucket_cap_mb=0.1)  # several buckets per backward
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rw = Recorder(rank)
    watch = Watcher(rw, ddp, optimizer, heartbeat_s=0.01, memory=False, update_every=0)
    generator = torch.Generator().manual_seed(rank)
    sleeps = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 1, generator=generator)
        if rank == SLOW_RANK:
            started = time.perf_counter()
            time.sleep(SLOW_S)  # a slow data pipeline, a throttled GPU: this rank's own work
            sleeps.append((started, time.perf_counter()))
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        watch.end_step(loss)
    watch.close()
    checksum = float(sum(p.detach().double().sum() for p in ddp.parameters()))

    # Only one comm hook per model: with one already there, training goes on, untimed.
    other = DDP(model())
    other.register_comm_hook(None, lambda _state, bucket: _allreduce(bucket))
    untimed_rw = Recorder(rank)
    untimed = Watcher(
        untimed_rw,
        other,
        torch.optim.SGD(other.parameters(), lr=0.01),
        heartbeat_s=None,
        memory=False,
        update_every=0,
    )
    other(torch.randn(4, 32)).sum().backward()
    untimed.end_step(None)
    untimed.close()

    result = {
        "steps": [(e.step, e.step_time_s, e.compute_s) for e in rw.steps],
        "heartbeats": rw.heartbeats,
        "sleeps": sleeps,
        "checksum": checksum,
        "untimed": {"timer": untimed.sync_timer is not None, "compute_s": untimed_rw.steps[0].compute_s},
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Leave together, with no DDP reducer alive, then skip interpreter teardown: gloo's threads
    # torn down by the interpreter at exit occasionally abort the process ("terminate called
    # without an active exception") after everything this test checks is written.
    dist.barrier()
    del ddp, other
    dist.destroy_process_group()
    os._exit(0)


def _allreduce(bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ddp")
    started = time.monotonic()
    ctx = mp.start_processes(
        _worker, args=(str(tmp / "rendezvous"), str(tmp)), nprocs=WORLD, join=False, start_method="spawn"
    )
    while not ctx.join(timeout=1):  # raises if a rank failed
        assert time.monotonic() - started < 90, "DDP ranks did not finish"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_compute_time_shows_the_slow_rank_while_step_time_is_the_same_on_every_rank(ranks):
    assert len({r["checksum"] for r in ranks}) == 1  # the hook kept DDP's gradients: replicas agree
    compute, step_time = [], []
    for r in ranks:
        steady = [s for s in r["steps"] if s[0] >= 2]  # past DDP's bucket rebuild after step 0
        assert len(steady) == STEPS - 2 and all(s[2] is not None for s in r["steps"])
        compute.append(statistics.median(s[2] for s in steady))
        step_time.append(statistics.median(s[1] for s in steady))
    fast = max(compute[r] for r in range(WORLD) if r != SLOW_RANK)
    assert compute[SLOW_RANK] - fast > 0.1, compute
    assert compute[SLOW_RANK] >= SLOW_S and fast < 0.05, compute
    assert min(step_time) >= SLOW_S and max(step_time) - min(step_time) < 0.03, step_time


def test_a_heartbeat_during_the_slow_ranks_work_says_who_waits(ranks):
    windows = [(a + 0.04, b - 0.02) for a, b in ranks[SLOW_RANK]["sleeps"][2:]]

    def during(rank: int) -> list[bool | None]:
        return [
            in_sync for t, _step, in_sync in ranks[rank]["heartbeats"] if any(a <= t <= b for a, b in windows)
        ]

    for rank in range(WORLD):
        seen = during(rank)
        assert len(seen) >= len(windows), (rank, len(seen))  # several beats per window
        if rank == SLOW_RANK:
            assert set(seen) == {False}, seen
        else:
            assert set(seen) == {True}, seen


def test_a_model_with_a_comm_hook_already_trains_untimed(ranks):
    for r in ranks:
        assert r["untimed"] == {"timer": False, "compute_s": None}


def test_no_timing_for_a_model_that_is_not_ddp():
    m = model()
    rw = Recorder(0)
    watch = Watcher(rw, m, torch.optim.SGD(m.parameters(), lr=0.1), heartbeat_s=60, memory=False)
    watch.heartbeat.stop()
    assert watch.sync_timer is None and watch.heartbeat.in_sync is None
    assert watch.heartbeat.beat() and rw.heartbeats[-1][2] is None  # not measured: left out
    m(torch.randn(2, 32)).sum().backward()
    watch.end_step(None)
    watch.close()
    assert rw.steps[0].compute_s is None
