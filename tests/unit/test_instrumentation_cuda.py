"""The watcher on CUDA: same numbers as the references, asynchronous host copy, memory fields.
Runs where CUDA exists (the device tool's GPU machines); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runwatch.producer.instrument.watch import Watcher
from tests.unit.test_instrumentation import RecordingPublisher, reference_module_norms

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
        assert memory.allocated > 0 and memory.reserved >= memory.allocated and memory.peak >= memory.allocated
        assert memory.ooms == 0 and memory.alloc_retries is not None
