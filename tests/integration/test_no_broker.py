"""With no broker reachable, a real training loop runs unhindered: construction returns at
once, publishing never blocks or raises, and close() is bounded and accounts for every event: each
one is in the disk spool, to be replayed when the run restarts with a broker."""

from __future__ import annotations

import time

import pytest
import torch

from runwatch.producer import ActionListener, RunWatch
from runwatch.streams.local.broker import free_port

pytestmark = pytest.mark.integration


def test_training_loop_is_not_blocked_without_a_broker(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    t0 = time.perf_counter()
    rw = RunWatch("no-broker-run", dead, max_block_ms=200, spool_dir=tmp_path / "spool")
    listener = ActionListener(rw, secret="x" * 32)
    construct_s = time.perf_counter() - t0

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publish_s = []
    steps = 200
    for step in range(1, steps + 1):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = time.perf_counter()
        rw.step(step, loss=float(loss), grad_norm=1.0)
        publish_s.append(time.perf_counter() - t)
        assert listener.poll(step) == []

    # A blocking send would cost max_block_ms (200 ms) per call: 40 s for the loop.
    assert construct_s < 1.0
    assert sum(publish_s) < 1.0
    t = time.perf_counter()
    stats = rw.close(timeout=2.0)
    assert time.perf_counter() - t < 8.0
    listener.close()
    offered = steps + 2  # run_start and run_end
    assert stats.published == 0
    assert stats.dropped == 0 and stats.drop_reasons == {}
    assert stats.spooled == stats.spooled_at_close == offered
    assert any((tmp_path / "spool").glob("*.seg"))
