"""``rw.watch(..., activations=True)``: per-module output RMS and zero fraction on sampled steps, equal to a
straightforward reference; nothing on the other steps; the hooks gone after ``close()``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runwatch.contract.limit_checks import _check_step
from runwatch.contract.schema import StepEvent, WireLimits
from runwatch.producer.instrument.watch import Watcher
from tests.producer.test_instrumentation import RecordingPublisher


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def reference(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    h = x
    for i, layer in enumerate(model.encoder):
        h = layer(h)
        out[f"encoder.{i}"] = (h.double().pow(2).mean().sqrt().item(), (h == 0).double().mean().item())
    y = model.head(h)
    out["head"] = (y.double().pow(2).mean().sqrt().item(), (y == 0).double().mean().item())
    return out


def run(steps: int, every: int, activations: bool = True):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pub = RecordingPublisher()
    watch = Watcher(
        pub, model, opt, heartbeat_s=None, memory=False, activations=activations, activations_every=every
    )
    refs = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            refs.append(reference(model, x))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.end_step(loss)
    watch.close()
    return model, watch, pub.steps, refs


def test_sampled_steps_carry_rms_and_zero_fraction_equal_to_a_reference():
    _, _, events, refs = run(steps=7, every=3)
    sampled = [e.step for e in events if e.module_activations]
    assert sampled == [0, 3, 6]
    for e in events:
        if not e.module_activations:
            continue
        ref = refs[e.step]
        assert set(e.module_activations) == set(ref)
        for name, stats in e.module_activations.items():
            rms, zero = ref[name]
            assert stats.rms == pytest.approx(rms, rel=1e-5)
            assert stats.zero_frac == pytest.approx(zero, abs=1e-12)
    relu = events[0].module_activations["encoder.1"]
    assert 0.2 < relu.zero_frac < 0.8  # a ReLU's output is about half zeros


def test_off_by_default_and_hooks_removed_on_close():
    model, _, events, _ = run(steps=3, every=1, activations=False)
    assert all(not e.module_activations for e in events)
    model, watch, events, _ = run(steps=3, every=1)
    assert all(e.module_activations for e in events)
    assert all(not m._forward_hooks for m in model.modules())
    assert watch.errors == 0


def test_eval_mode_forwards_are_left_out_and_accumulation_sums():
    torch.manual_seed(1)
    model = Tiny()
    pub = RecordingPublisher()
    watch = Watcher(pub, model, None, heartbeat_s=None, memory=False, activations=True, activations_every=1)
    xs = [torch.randn(4, 8), torch.randn(12, 8)]
    for x in xs:  # two micro-batches of one step
        model(x)
    model.eval()
    model(torch.full((5, 8), 100.0))  # an eval forward in the same step: not counted
    model.train()
    watch.end_step(1.0)
    watch.close()
    h = torch.cat(xs)
    expected = reference(model, h)
    stats = pub.steps[0].module_activations
    for name, (rms, zero) in expected.items():
        assert stats[name].rms == pytest.approx(rms, rel=1e-5)
        assert stats[name].zero_frac == pytest.approx(zero, abs=1e-12)


def test_module_activations_are_bounded_like_module_grad_norms():
    event = StepEvent(
        run_id="r", step=0, module_activations={f"m{i}": {"rms": 1.0, "zero_frac": 0.0} for i in range(5)}
    )
    assert "module_activations" in (_check_step(event, WireLimits(max_modules=4)) or "")
    assert _check_step(event, WireLimits(max_modules=5)) is None
    assert not math.isnan(event.module_activations["m0"].rms)


def test_hooks_are_registered_only_for_sampled_steps():
    torch.manual_seed(2)
    model = Tiny()
    pub = RecordingPublisher()
    watch = Watcher(pub, model, None, heartbeat_s=None, memory=False, activations=True, activations_every=3)
    hooked = []
    for _ in range(7):
        hooked.append(bool(model.encoder[1]._forward_hooks))  # before the step's forward
        model(torch.randn(4, 8))
        watch.end_step(1.0)
    watch.close()
    assert hooked == [True, False, False, True, False, False, True]
    assert [bool(e.module_activations) for e in pub.steps] == hooked
    assert not model.encoder[1]._forward_hooks
