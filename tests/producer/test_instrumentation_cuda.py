"""The watcher on CUDA: same numbers as the references, asynchronous host copy, memory fields, and
DDP timing by CUDA events. Runs where CUDA exists (a lent GPU machine); skipped elsewhere."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from runwatch.producer.instrument.watch import Watcher
from tests.producer.test_instrumentation import RecordingPublisher, reference_module_norms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_watcher_numbers_async_copy_and_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, update_every=1, heartbeat_s=None)
    x = torch.randn(128, 64, device="cuda")
    references = []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        references.append((reference_module_norms(model), loss.item()))
        optimizer.step()
        watch.end_step(loss)
        # the step's figures are copied asynchronously and published at the next end_step
        assert len(rw.steps) == step
    watch.close()
    assert [e.step for e in rw.steps] == [0, 1, 2]
    for event, (norms, loss) in zip(rw.steps, references, strict=True):
        assert event.loss == pytest.approx(loss, rel=1e-6)
        for name, value in norms.items():
            assert event.module_grad_norms[name] == pytest.approx(value, rel=1e-5)
        assert event.effective_lr_ratio == pytest.approx(0.01, rel=1e-4)
        memory = event.memory
        assert (
            memory.allocated > 0 and memory.reserved >= memory.allocated and memory.peak >= memory.allocated
        )
        assert memory.ooms == 0 and memory.alloc_retries is not None


def _gpu_sleep_cycles(seconds: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy about ``seconds`` (measured, not assumed)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles * 20)  # let the clocks ramp up from idle first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1000.0))


def test_ddp_timing_on_cuda_follows_the_gpu_not_the_host(tmp_path):
    """DDP over NCCL (one rank): the host only launches kernels, so the step's compute time and
    the heartbeat's in_sync must come from CUDA events. The GPU sleeps SLEEP_S before the forward
    (the rank's own work) and again after the backward launched its gradient sync (waiting)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    sleep_s, steps = 0.05, 8
    cycles = _gpu_sleep_cycles(sleep_s)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda(), device_ids=[0])
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        rw = RecordingPublisher()
        watch = Watcher(rw, ddp, optimizer, update_every=0, heartbeat_s=None, memory=False)
        assert watch.sync_timer is not None
        x = torch.randn(32, 64, device="cuda")
        seen: list[bool | None] = []
        own_work = []  # (start, end) events around each step's own-work sleep: its real length on the GPU
        for step in range(steps):
            own_work.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            own_work[-1][0].record()
            torch.cuda._sleep(cycles)  # own work: the GPU has not reached the sync point
            own_work[-1][1].record()
            loss = ddp(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()  # launches the all-reduce of the last bucket
            torch.cuda._sleep(cycles)  # past the sync point: waiting, as for a slow peer
            optimizer.step()
            watch.end_step(loss)
            if step == steps - 1:
                # the host is far ahead of the GPU: poll while the GPU works through this step
                deadline = time.monotonic() + 10
                while torch.cuda.current_stream().query() is False and time.monotonic() < deadline:
                    seen.append(watch.sync_timer.in_sync())
                    time.sleep(0.001)
        watch.close()
        torch.cuda.synchronize()
        slept = [a.elapsed_time(b) / 1000.0 for a, b in own_work]
    finally:
        dist.destroy_process_group()
    assert [e.step for e in rw.steps] == list(range(steps))
    compute = [(e.compute_s, slept[e.step]) for e in rw.steps if e.step >= 2]  # past DDP's bucket rebuild
    assert all(c is not None for c, _ in compute), compute
    # the host reaches the sync point a millisecond or two into the step; the GPU only after its own work
    assert all(s > 0.5 * sleep_s and s <= c <= s + 0.03 for c, s in compute), compute
    # in_sync while the GPU works through the last step: own work (False), then waiting (True)
    first_true = seen.index(True)
    assert False in seen[:first_true] and seen.count(True) >= 10, seen
