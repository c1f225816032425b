"""The numbers ``rw.watch`` puts in step events equal straightforward references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runwatch.contract.schema import StepEvent
from runwatch.producer.instrument.categories import category_loss
from runwatch.producer.instrument.gradstats import ROOT_MODULE, ParamLayout, grad_norms
from runwatch.producer.instrument.step_packing import StepPacking
from runwatch.producer.instrument.watch import Watcher
from runwatch.scenarios.clocks import SimulatedClock

REL = 1e-5


class RecordingPublisher:
    """Stands in for RunWatch in these unit tests: validates every event against the wire schema."""

    def __init__(self):
        self.steps: list[StepEvent] = []
        self.evals: list[dict] = []
        self.heartbeats: list[tuple] = []

    def step(self, step: int, **fields) -> bool:
        self.steps.append(StepEvent(run_id="unit", step=step, **fields))
        return True

    def eval(self, step: int, **fields) -> bool:
        self.evals.append({"step": step, **fields})
        return True

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None) -> bool:
        self.heartbeats.append((step, phase, time_in_phase_s))
        return True


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.ones(width))  # a bare parameter owned by the block

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.gain


class Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(width))  # owned by the root module
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 1)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(self.blocks(x + self.offset))


def make(seed: int = 0, width: int = 16):
    torch.manual_seed(seed)
    model = Net(width)
    x = torch.randn(32, width)
    y = torch.randn(32, 1)
    return model, x, y


def backward(model, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def reference_module_norms(model: nn.Module) -> dict[str, float]:
    out = {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            out[name or ROOT_MODULE] = math.sqrt(
                sum(torch.linalg.vector_norm(p.grad).item() ** 2 for p in own)
            )
    return out


def test_module_and_global_grad_norms_equal_per_parameter_vector_norms():
    model, x, y = make()
    backward(model, x, y)
    result = grad_norms(ParamLayout(model))
    names = ParamLayout(model).module_names
    reference = reference_module_norms(model)
    assert (
        set(names)
        == {ROOT_MODULE, "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.fc", "head"}
        == set(reference)
    )
    assert "frozen" not in names  # no trainable parameters, no entry
    for name, value in zip(names, result.modules.tolist(), strict=True):
        assert value == pytest.approx(reference[name], rel=REL)
    every_param = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert result.total.item() == pytest.approx(torch.linalg.vector_norm(every_param).item(), rel=REL)
    assert result.nonfinite.item() == 0


def test_mixed_dtypes_are_grouped_and_still_exact():
    model, x, y = make()
    model.head.double()
    loss = nn.functional.mse_loss(model.head(model.blocks(x + model.offset).double()), y.double())
    loss.backward()
    result = grad_norms(ParamLayout(model))
    reference = reference_module_norms(model)
    got = dict(zip(ParamLayout(model).module_names, result.modules.tolist(), strict=True))
    for name, value in reference.items():
        assert got[name] == pytest.approx(value, rel=REL)


def test_clipping_matches_torch_clip_grad_norm_and_the_ratio_by_hand():
    model, x, y = make()
    twin, _, _ = make()
    backward(model, x, y)
    backward(twin, x, y)
    expected_total = torch.nn.utils.clip_grad_norm_([p for p in twin.parameters() if p.requires_grad], 0.05)
    result = grad_norms(ParamLayout(model), 0.05)
    total = result.total.item()
    assert total == pytest.approx(expected_total.item(), rel=REL)
    assert total > 0.05  # the case where clipping acts
    assert result.clip_coef.item() == pytest.approx(0.05 / (total + 1e-6), rel=REL)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        if mine.requires_grad:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-9)


def test_nonfinite_gradients_are_counted():
    model, x, y = make()
    backward(model, x, y)
    model.head.weight.grad[0, 0] = float("nan")
    model.blocks[0].gain.grad[3] = float("inf")
    result = grad_norms(ParamLayout(model))
    assert result.nonfinite.item() == 2
    assert math.isnan(result.total.item())


def run_watched(optimizer_factory, steps: int, update_every: int, clip: float | None = None, seed: int = 0):
    model, x, y = make(seed)
    optimizer = optimizer_factory(model)
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, clip=clip, update_every=update_every, heartbeat_s=None)
    snapshots = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = backward(model, x, y)
        before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        optimizer.step()
        after = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        snapshots.append((before, after))
        watch.end_step(loss, samples=len(x))
    watch.close()
    return rw.steps, snapshots


def flat_norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors])).item()


def test_update_norm_equals_an_explicit_before_after_snapshot_every_k_steps():
    steps, snapshots = run_watched(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=7, update_every=3
    )
    assert [e.step for e in steps] == list(range(7))
    with_update = [e.step for e in steps if e.update_norm is not None]
    assert with_update == [0, 3, 6]
    for event in steps:
        if event.update_norm is None:
            assert event.param_norm is None and event.relative_update_norm is None
            continue
        before, after = snapshots[event.step]
        expected_update = flat_norm([a - b for a, b in zip(after, before, strict=True)])
        expected_param = flat_norm(before)
        assert event.update_norm == pytest.approx(expected_update, rel=REL)
        assert event.param_norm == pytest.approx(expected_param, rel=REL)
        assert event.relative_update_norm == pytest.approx(expected_update / expected_param, rel=REL)


def test_plain_sgd_effective_lr_ratio_is_the_learning_rate():
    lr = 0.03
    steps, _ = run_watched(
        lambda m: torch.optim.SGD(m.parameters(), lr=lr), steps=4, update_every=1, clip=0.05
    )
    for event in steps:
        assert event.clip_ratio < 1  # clipping acted, so the ratio uses the clipped norm
        assert event.grad_norm_clipped == pytest.approx(event.grad_norm * event.clip_ratio, rel=REL)
        assert event.grad_norm_clipped == pytest.approx(0.05, rel=1e-4)
        assert event.effective_lr_ratio == pytest.approx(lr, rel=REL)
        assert event.lr == [lr]


def test_step_events_carry_loss_lr_module_norms_and_timing():
    steps, _ = run_watched(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), steps=3, update_every=0)
    for event in steps:
        assert event.loss is not None and math.isfinite(event.loss)
        assert set(event.module_grad_norms) == {
            ROOT_MODULE,
            "blocks.0",
            "blocks.0.fc",
            "blocks.1",
            "blocks.1.fc",
            "head",
        }
        assert event.grad_norm_clipped is None and event.clip_ratio is None  # nothing clips
        assert event.update_norm is None  # update_every=0 turns it off
        assert event.step_time_s > 0 and event.samples_per_s > 0
        assert event.nonfinite_grads == 0


def test_per_category_means_match_a_hand_computation_on_uneven_batches():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    labels = ["speech", "music", "speech", "speech", "noise"]
    lengths = torch.tensor([1, 2, 3, 4, 5])
    by_length = category_loss(losses, labels, lengths=lengths).resolve()
    assert by_length["speech"].mean == pytest.approx((1 * 1 + 3 * 3 + 4 * 4) / (1 + 3 + 4))
    assert by_length["speech"].count == 3
    assert by_length["music"].mean == pytest.approx(2.0) and by_length["music"].count == 1
    assert by_length["noise"].mean == pytest.approx(10.0) and by_length["noise"].count == 1

    unweighted = category_loss(losses, torch.tensor([0, 1, 0, 0, 2]), names=["a", "b", "c", "d"]).resolve()
    assert unweighted["a"].mean == pytest.approx((1 + 3 + 4) / 3)
    assert "d" not in unweighted  # no sample this batch: absent, not zero

    # a second, smaller batch with a category the first one lacked, summed as micro-batches
    second = category_loss(torch.tensor([5.0, 7.0]), ["music", "silence"], weights=torch.tensor([3.0, 1.0]))
    total = (category_loss(losses, labels, weights=lengths.float()) + second).resolve()
    assert total["music"].mean == pytest.approx((2 * 2 + 5 * 3) / (2 + 3))
    assert total["music"].count == 2
    assert total["silence"].mean == pytest.approx(7.0)
    assert total["speech"].count == 3


def test_category_loss_travels_in_the_step_event():
    model, x, y = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None)
    optimizer.zero_grad()
    per_sample = ((model(x) - y) ** 2).mean(dim=1)
    per_sample.mean().backward()
    optimizer.step()
    cats = category_loss(per_sample, torch.arange(32) % 3, names=["x", "y", "z"])
    watch.end_step(per_sample.mean(), category_loss=cats)
    watch.close()
    event = rw.steps[0]
    assert set(event.category_loss) == {"x", "y", "z"}
    assert event.category_loss["x"].mean == pytest.approx(per_sample[0::3].mean().item(), rel=REL)
    assert event.category_loss["x"].count == 11


def test_category_loss_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="labels"):
        category_loss(torch.ones(3), ["a", "b"])
    with pytest.raises(ValueError, match="not both"):
        category_loss(torch.ones(2), ["a", "b"], weights=torch.ones(2), lengths=torch.ones(2))
    with pytest.raises(ValueError, match="per-sample"):
        category_loss(torch.ones(2, 2), ["a", "b"])


def test_watch_rejects_bad_arguments():
    model, _, _ = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not both"):
        Watcher(RecordingPublisher(), model, optimizer, clip=1.0, external_clip=1.0, heartbeat_s=None)
    with pytest.raises(ValueError, match="clip"):
        Watcher(RecordingPublisher(), model, optimizer, clip=0.0, heartbeat_s=None)
    with pytest.raises(ValueError, match="no trainable"):
        Watcher(RecordingPublisher(), nn.Linear(2, 2).requires_grad_(False), optimizer, heartbeat_s=None)


def test_data_wait_memory_and_heartbeat_phases_come_with_the_steps():
    model, x, y = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RecordingPublisher()
    # the caller's clock: no sleeps; the heartbeat beats as the clock advances
    clock = SimulatedClock(heartbeat_s=0.02)
    watch = Watcher(rw, model, optimizer, heartbeat_s=0.02, clock=clock.seconds)
    clock.bind(watch.heartbeat)

    def slow_loader():
        for _ in range(3):
            clock.advance(0.05)  # a data loader that makes the step wait
            yield x, y

    for bx, by in watch.data(slow_loader()):
        optimizer.zero_grad()
        loss = backward(model, bx, by)
        optimizer.step()
        clock.advance(0.01)
        watch.end_step(loss, samples=len(bx))
    with watch.phase("eval"):
        clock.advance(0.06)
    watch.close()
    assert [e.step for e in rw.steps] == [0, 1, 2]
    assert [e.data_wait_s for e in rw.steps] == pytest.approx([0.05] * 3)
    assert [e.step_time_s for e in rw.steps] == pytest.approx([0.06] * 3)
    for event in rw.steps:  # on a clock of the caller's, memory is sampled every step
        assert event.memory is not None and event.memory.host_rss > 0  # /proc is there on Linux
        assert event.memory.allocated is None  # no CUDA here: absent, not zero
    phases = {phase for _, phase, _ in rw.heartbeats}
    assert {"dataload", "eval"} <= phases
    assert any(step == 2 and phase == "eval" for step, phase, _ in rw.heartbeats)


def test_eval_time_is_left_out_of_the_step_time_and_lr_is_the_one_the_step_used():
    model, x, y = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    rw = RecordingPublisher()
    clock = SimulatedClock()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, clock=clock.seconds)
    for i in range(3):
        optimizer.zero_grad()
        loss = backward(model, x, y)
        optimizer.step()
        clock.advance(0.01)
        scheduler.step()  # before end_step, as Lightning and HF do
        if i == 1:
            with watch.phase("eval"):
                clock.advance(0.2)
        watch.end_step(loss)
    watch.set_phase("checkpoint")
    clock.advance(0.2)
    watch.set_phase("train")
    optimizer.zero_grad()
    loss = backward(model, x, y)
    optimizer.step()
    clock.advance(0.01)
    watch.end_step(loss)
    watch.close()
    assert [e.lr for e in rw.steps] == [[0.1], [0.05], [0.025], [0.0125]]
    # the eval and the checkpoint (0.2 s each) are in no step's time: each step is its 0.01 s of work
    assert [e.step_time_s for e in rw.steps] == pytest.approx([0.01] * 4)
    assert all(e.data_wait_s is None for e in rw.steps)  # no wrapped loader: absent, not zero
    # ... and each step says the off-step time before it by phase (what goodput counts as evals and saves)
    assert [e.off_step_s for e in rw.steps] == [
        None,
        {"eval": pytest.approx(0.2)},
        None,
        {"checkpoint": pytest.approx(0.2)},
    ]


def test_a_failure_inside_runwatch_is_counted_not_raised_into_training(caplog):
    model, x, y = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None)
    optimizer.zero_grad()
    loss = backward(model, x, y)
    optimizer.step()
    watch.end_step(loss, category_loss="not a category batch")  # a caller's slip
    optimizer.zero_grad()
    loss = backward(model, x, y)
    optimizer.step()
    watch.end_step(loss)
    watch.close()
    assert watch.errors == 1
    assert "end_step failed" in caplog.text
    assert [e.step for e in rw.steps] == [1]  # training went on and the next step was published


def test_three_shards_combine_into_the_full_model_by_root_sum_of_squares():
    names = [n for n, p in make()[0].named_parameters() if p.requires_grad]
    shards = [names[i::3] for i in range(3)]  # round robin: blocks.*.fc weight and bias land apart
    assert {"blocks.0.fc.weight", "blocks.0.fc.bias"} <= set(names)

    def run(shard):
        model, x, y = make()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rw = RecordingPublisher()
        watch = Watcher(
            rw,
            model,
            optimizer,
            update_every=1,
            heartbeat_s=None,
            memory=False,
            shard=shard,
            external_clip=0.05 if shard is not None else None,
        )
        for _ in range(2):
            optimizer.zero_grad()
            loss = backward(model, x, y)
            optimizer.step()
            watch.end_step(loss)
        watch.close()
        return rw.steps

    full = run(None)
    # the callable form selects the same parameters as the names
    parts = [run(shards[0]), run(shards[1]), run(lambda name, _p: name in shards[2])]
    for i, event in enumerate(full):
        events = [p[i] for p in parts]
        assert all(e.grad_sharded for e in events) and not event.grad_sharded

        def rss(values):
            return math.sqrt(sum(v * v for v in values))

        for key in ("grad_norm", "param_norm", "update_norm"):
            assert rss(getattr(e, key) for e in events) == pytest.approx(getattr(event, key), rel=1e-6), key
        for module, value in event.module_grad_norms.items():
            assert rss(e.module_grad_norms.get(module, 0.0) for e in events) == pytest.approx(value, rel=1e-6)
        # a module owning no parameter of a shard is absent there, not zero
        for shard, e in zip(shards, events, strict=True):
            owners = {n.rsplit(".", 1)[0] if "." in n else ROOT_MODULE for n in shard}
            assert set(e.module_grad_norms) == owners
        # a shard's clip factor and ratios need the global norm: left to the join
        assert all(
            e.clip_ratio is None and e.grad_norm_clipped is None and e.relative_update_norm is None
            for e in events
        )


def test_shard_rejects_clip_unknown_names_and_an_empty_selection():
    model, _, _ = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="external_clip"):
        Watcher(RecordingPublisher(), model, optimizer, clip=1.0, shard=["head.weight"], heartbeat_s=None)
    with pytest.raises(ValueError, match="does not have: head.wieght"):
        Watcher(RecordingPublisher(), model, optimizer, shard=["head.wieght"], heartbeat_s=None)
    with pytest.raises(ValueError, match="selects none"):
        Watcher(RecordingPublisher(), model, optimizer, shard=["frozen.weight"], heartbeat_s=None)


def test_a_steps_packed_figures_come_back_by_name_as_float64():
    packing = StepPacking()
    packing.add("loss", torch.tensor([2.5], dtype=torch.float32))
    packing.add("grad_norm", torch.tensor([3.0], dtype=torch.float64))
    packing.add("nonfinite_grads", torch.tensor([1]), 1)
    packing.add("module_grad_norms", torch.tensor([1.0, 2.0], dtype=torch.float64))
    packed = packing.pack(torch.device("cpu"))
    assert packed.dtype == torch.float64 and packed.numel() == 5
    assert packing.unpack(packed.tolist()) == {
        "loss": [2.5],
        "grad_norm": [3.0],
        "nonfinite_grads": [1.0],
        "module_grad_norms": [1.0, 2.0],
    }
    assert StepPacking().pack(torch.device("cpu")) is None  # nothing measured: no copy


def test_a_fast_loop_on_the_wall_clock_shares_memory_samples_a_simulated_one_samples_every_step():
    from runwatch.producer.instrument.watch import MEMORY_INTERVAL_S

    model, x, y = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fast = RecordingPublisher()
    watch = Watcher(fast, model, optimizer, heartbeat_s=None)
    for _ in range(20):  # far faster than MEMORY_INTERVAL_S per step
        optimizer.zero_grad()
        loss = backward(model, x, y)
        optimizer.step()
        watch.end_step(loss)
    watch.close()
    sampled = [e.step for e in fast.steps if e.memory is not None]
    assert sampled[0] == 0 and len(sampled) < len(fast.steps)
    assert MEMORY_INTERVAL_S > 0

    ticks = iter(range(1000))
    simulated = RecordingPublisher()
    watch = Watcher(simulated, model, optimizer, heartbeat_s=None, clock=lambda: next(ticks) * 1e-3)
    for _ in range(5):
        optimizer.zero_grad()
        loss = backward(model, x, y)
        optimizer.step()
        watch.end_step(loss)
    watch.close()
    assert all(e.memory is not None for e in simulated.steps)
