"""The Lightning callback and the HF TrainerCallback against the plain loop, with the real
frameworks on a tiny seeded CPU model, publishing to the real embedded broker.

Each run trains 20 optimizer steps with clipping by total norm, update norms every 5 steps,
a short heartbeat and two evaluations. The frameworks accumulate 2 batches per optimizer step,
so "one step event per optimizer step" is tested, not "one per batch". Where CUDA exists, one
more test trains the HF Trainer with fp16 AMP (the callback must unscale before it clips).
"""

from __future__ import annotations

import importlib.util
import math
import time
import uuid

import pytest

from runwatch.contract import topics
from runwatch.producer import RunWatch, decode_event
from tests.conftest import read_topic

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration

STEPS = 20
BATCH = 8
ACCUMULATE = 2
UPDATE_EVERY = 5
EVAL_EVERY = 10
CLIP = 0.5
LR = 0.05
HEARTBEAT_S = 0.1
EVAL_BATCH_S = 0.15  # each eval batch sleeps this long: evaluation outlasts a heartbeat period
FEATURES, HIDDEN, CLASSES = 8, 16, 4
MODULES = {"net.0", "net.2", "net.4"}  # the Linear layers of TinyNet
# Fields every step event carries in all three setups (update norms only every UPDATE_EVERY steps).
STEP_FIELDS = {
    "loss",
    "lr",
    "grad_norm",
    "grad_norm_clipped",
    "clip_ratio",
    "module_grad_norms",
    "step_time_s",
    "samples_per_s",
    "nonfinite_grads",
}
UPDATE_FIELDS = {"param_norm", "update_norm", "relative_update_norm"}
# Neither framework lets a callback wrap its data loader, so data wait is absent there (not zero).
NOT_FROM_FRAMEWORKS = {"data_wait_s"}

needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="PyTorch Lightning is not installed (pip install 'runwatch[lightning]')",
)
needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="transformers/accelerate are not installed (pip install 'runwatch[hf]')",
)


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


class TinyNet(torch.nn.Module):
    """HF-style module: returns a dict with the loss when given labels."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x, labels=None):
        if not self.training:
            time.sleep(EVAL_BATCH_S)
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g) * 3  # large inputs: gradients above CLIP, so clipping acts
    return x, torch.randint(0, CLASSES, (n,), generator=g)


class Pairs(torch.utils.data.Dataset):
    """The HF Trainer's dataset: dicts of inputs and labels."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _read_run(bootstrap: str, run_id: str) -> list:
    def mine(records):
        return [r for r in records if r.key == run_id.encode()]

    records = read_topic(
        bootstrap,
        topics.TELEMETRY,
        until=lambda rs: any(decode_event(r.value).kind == "run_end" for r in mine(rs)),
    )
    return [decode_event(r.value) for r in mine(records)]


def _summary(events: list) -> dict:
    steps = [e for e in events if e.kind == "step"]
    populated = set.intersection(
        *({k for k, v in s.model_dump(exclude_none=True).items() if v not in ({}, [])} for s in steps)
    )
    return {
        "kinds": {e.kind for e in events},
        "steps": steps,
        "step_numbers": [s.step for s in steps],
        "populated": populated,
        "update_steps": [s.step for s in steps if s.update_norm is not None],
        "evals": [e for e in events if e.kind == "eval"],
        "phases": {e.phase for e in events if e.kind == "heartbeat"},
    }


def _check_steps(summary: dict) -> None:
    steps = summary["steps"]
    assert summary["step_numbers"] == list(range(1, STEPS + 1))  # one event per optimizer step
    assert STEP_FIELDS <= summary["populated"], STEP_FIELDS - summary["populated"]
    for s in steps:
        assert set(s.module_grad_norms) == MODULES
        assert math.isfinite(s.grad_norm) and s.grad_norm > 0
        assert all(math.isfinite(v) and v > 0 for v in s.module_grad_norms.values())
        # module norms combine into the global norm
        assert math.sqrt(sum(v * v for v in s.module_grad_norms.values())) == pytest.approx(
            s.grad_norm, rel=1e-6
        )
        assert s.grad_norm_clipped == pytest.approx(min(s.grad_norm, CLIP), rel=1e-4)
        assert 0 < s.clip_ratio <= 1
        assert math.isfinite(s.loss) and 0 < s.loss < 10
        assert s.nonfinite_grads == 0
        assert s.samples_per_s > 0 and s.step_time_s > 0
    assert any(s.grad_norm > 1.5 * CLIP for s in steps), "the test wants clipping to act"
    assert summary["update_steps"] == [n for n in range(1, STEPS + 1) if n % UPDATE_EVERY == 0]
    for s in steps:
        if s.update_norm is not None:
            assert {k for k in UPDATE_FIELDS if getattr(s, k) is not None} == UPDATE_FIELDS
            assert s.update_norm > 0 and s.param_norm > 0
            # plain SGD: update = lr * clipped gradient, so this holds only if the clipped norm is
            # right and the update was measured across exactly this step's optimizer.step()
            assert s.effective_lr_ratio == pytest.approx(LR, rel=1e-4)


def _check_evals(summary: dict) -> None:
    assert {"train", "eval"} <= summary["phases"]  # heartbeats say when the run is evaluating
    evals = summary["evals"]
    assert [e.step for e in evals] == [EVAL_EVERY, 2 * EVAL_EVERY]
    for e in evals:
        assert e.split == "val"
        assert e.loss is not None and math.isfinite(e.loss) and e.loss > 0


def _check_framework_step_times(summary: dict) -> None:
    for s in summary["steps"]:
        assert s.samples_per_s == pytest.approx(ACCUMULATE * BATCH / s.step_time_s, rel=1e-6)


@pytest.fixture(scope="module")
def plain(broker) -> dict:
    """The reference: a plain loop with ``rw.watch(..., hooks=True)``."""
    run_id = f"plain-{uuid.uuid4().hex[:8]}"
    rw = RunWatch(run_id, broker.bootstrap)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(STEPS * BATCH, seed=1)
    vx, vy = _data(2 * BATCH, seed=2)
    w = rw.watch(
        model, optimizer, clip=CLIP, update_every=UPDATE_EVERY, heartbeat_s=HEARTBEAT_S, first_step=1
    )
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    for step, (bx, by) in enumerate(w.data(batches), start=1):
        loss = model(bx, labels=by)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        w.end_step(loss, step=step, samples=len(bx))
        if step % EVAL_EVERY == 0:
            model.eval()
            with w.phase("eval"), torch.no_grad():
                losses = [
                    float(model(vx[i : i + BATCH], labels=vy[i : i + BATCH])["loss"]) for i in (0, BATCH)
                ]
                w.eval(step, "val", sum(losses) / len(losses))
            model.train()
    w.close()
    rw.close()
    return _summary(_read_run(broker.bootstrap, run_id))


def test_plain_loop_reference(plain):
    assert plain["kinds"] == {"run_start", "step", "eval", "heartbeat", "run_end"}
    _check_steps(plain)
    _check_evals(plain)


@needs_lightning
def test_lightning_callback_matches_plain_loop(broker, plain, tmp_path):
    import lightning.pytorch as pl

    from runwatch.producer.integrations.lightning import RunWatchCallback

    class TinyModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            time.sleep(EVAL_BATCH_S)
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))
            self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    x, y = _data(STEPS * ACCUMULATE * BATCH, seed=1)
    vx, vy = _data(2 * BATCH, seed=2)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(vx, vy), batch_size=BATCH)

    run_id = f"lightning-{uuid.uuid4().hex[:8]}"
    rw = RunWatch(run_id, broker.bootstrap)
    callback = RunWatchCallback(rw, update_every=UPDATE_EVERY, heartbeat_s=HEARTBEAT_S)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        val_check_interval=EVAL_EVERY * ACCUMULATE,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyModule(), train, val)
    rw.close()
    assert callback.watch is None  # closed at fit end

    got = _summary(_read_run(broker.bootstrap, run_id))
    assert got["kinds"] == plain["kinds"]
    assert NOT_FROM_FRAMEWORKS <= plain["populated"]
    assert got["populated"] == plain["populated"] - NOT_FROM_FRAMEWORKS
    _check_steps(got)
    _check_evals(got)
    assert [sorted(e.metrics) for e in got["evals"]] == [["acc"], ["acc"]]  # val_ prefix dropped, loss apart
    _check_framework_step_times(got)


@needs_lightning
def test_lightning_callback_guard_skips_a_nan_batch_before_it_lands(broker, tmp_path):
    """Issue 37: the callback's step guard runs in on_before_optimizer_step, inside optimizer.step(closure):
    a NaN batch's update is skipped there, the weights never hold a NaN, and the step event says so."""
    import lightning.pytorch as pl

    from runwatch.producer.integrations.lightning import RunWatchCallback

    class TinyModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    x, y = _data(STEPS * ACCUMULATE * BATCH, seed=1)
    nan_step = 12  # the callback numbers optimizer steps from 1: its batches are 22 and 23
    x[(nan_step - 1) * ACCUMULATE * BATCH, 0] = float("nan")
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    run_id = f"lightning-guard-{uuid.uuid4().hex[:8]}"
    rw = RunWatch(run_id, broker.bootstrap)
    module = TinyModule()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RunWatchCallback(rw, heartbeat_s=HEARTBEAT_S)],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, train)
    rw.close()
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    steps = [e for e in _read_run(broker.bootstrap, run_id) if e.kind == "step"]
    assert [(s.step, s.update_skipped) for s in steps if s.update_skipped] == [(nan_step, "nonfinite")]
    assert all(math.isfinite(s.loss) for s in steps if s.step != nan_step)


@needs_hf
def test_hf_callback_matches_plain_loop(broker, plain, tmp_path):
    from transformers import Trainer, TrainingArguments

    from runwatch.producer.integrations.hf import RunWatchCallback

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        per_device_eval_batch_size=BATCH,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=CLIP,
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    run_id = f"hf-{uuid.uuid4().hex[:8]}"
    rw = RunWatch(run_id, broker.bootstrap)
    callback = RunWatchCallback(rw, update_every=UPDATE_EVERY, heartbeat_s=HEARTBEAT_S)
    x, y = _data(STEPS * ACCUMULATE * BATCH, seed=1)

    def train(callbacks):
        trainer = Trainer(
            model=TinyNet(),
            args=args,
            train_dataset=Pairs(x, y),
            eval_dataset=Pairs(*_data(2 * BATCH, seed=2)),
            callbacks=callbacks,
        )
        trainer.train()
        return trainer

    trainer = train([callback])
    rw.close()
    assert callback.watch is None  # closed at train end
    assert args.max_grad_norm == CLIP  # handed back after training
    # runwatch clipped in the Trainer's place: the same weights as when the Trainer clips itself
    control = train([])
    for mine, theirs in zip(trainer.model.parameters(), control.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)

    got = _summary(_read_run(broker.bootstrap, run_id))
    assert got["kinds"] == plain["kinds"]
    assert got["populated"] == plain["populated"] - NOT_FROM_FRAMEWORKS
    _check_steps(got)
    _check_evals(got)
    _check_framework_step_times(got)
    # the loss the Trainer logs at every step (logging_steps=1) and its own pre-clip norm
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == got["step_numbers"]
    assert [s.loss for s in got["steps"]] == pytest.approx([h["loss"] for h in logged], abs=1e-4)
    if all("grad_norm" in h for h in logged):  # 5.17 logs it without clipping too; 5.0 does not
        assert [s.grad_norm for s in got["steps"]] == pytest.approx(
            [h["grad_norm"] for h in logged], rel=1e-5
        )


@needs_hf
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 AMP needs a CUDA device")
def test_hf_callback_unscales_fp16_gradients_before_it_clips(broker, tmp_path):
    """fp16 AMP on CUDA: the GradScaler multiplies the loss (by 65536 at first), so the gradients the
    callback sees at ``on_pre_optimizer_step`` are scaled unless it unscales them first. The norms it
    reports must be the true ones, the same the Trainer computes when it clips by itself."""
    from transformers import Trainer, TrainingArguments

    from runwatch.producer.integrations.hf import RunWatchCallback

    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=CLIP,
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    x, y = _data(STEPS * ACCUMULATE * BATCH, seed=1)

    def train(callbacks):
        trainer = Trainer(model=TinyNet(), args=args, train_dataset=Pairs(x, y), callbacks=callbacks)
        trainer.train()
        return trainer

    run_id = f"hf-fp16-{uuid.uuid4().hex[:8]}"
    rw = RunWatch(run_id, broker.bootstrap)
    callback = RunWatchCallback(rw, update_every=UPDATE_EVERY, heartbeat_s=HEARTBEAT_S)
    trainer = train([callback])
    rw.close()
    assert args.max_grad_norm == CLIP
    control = train([])  # the Trainer unscales and clips by itself, and logs the true pre-clip norm
    steps = [e for e in _read_run(broker.bootstrap, run_id) if e.kind == "step"]
    reference = [h for h in control.state.log_history if "grad_norm" in h]
    assert [s.step for s in steps] == [h["step"] for h in reference] == list(range(1, STEPS + 1))
    assert any((s.grad_norm or 0) > 1.5 * CLIP for s in steps), "the test wants clipping to act"
    skipped = [h["step"] for h in reference if not math.isfinite(h["grad_norm"])]
    assert len(skipped) <= 2, f"the scaler skipped steps {skipped}: too few left to compare"
    for s, h in zip(steps, reference, strict=True):
        if h["step"] in skipped:  # inf/NaN in the scaled gradients: no optimizer.step(), no gradient figures
            assert s.grad_norm is None or not math.isfinite(s.grad_norm)
            continue
        # scaled gradients would give norms thousands of times larger
        assert s.grad_norm == pytest.approx(h["grad_norm"], rel=1e-3), (s.step, s.grad_norm, h["grad_norm"])
        assert s.grad_norm_clipped == pytest.approx(min(s.grad_norm, CLIP), rel=1e-3)
        assert s.nonfinite_grads == 0
    # runwatch clipped in the Trainer's place: the same weights as when the Trainer clips itself
    for mine, theirs in zip(trainer.model.parameters(), control.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
