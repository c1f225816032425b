"""A real single-rank training run (an MLP classifier on CPU, SGD with momentum) with a fault, for
the rollback integration tests. Run as ``python fault_train.py --bootstrap B --run-id R --out DIR``.

It is instrumented as the README says (``RunWatch``, ``rw.watch``, ``ActionListener``, a checkpoint
every ``--checkpoint-every`` steps) and acts on what the worker sends. Faults (``--fault``):

- ``none``;
- ``lr_spike:S``: the LR is multiplied by 50 in step S (before its update, and it stays so), once:
  a replay after a rollback does not do it again. S is a checkpoint step, so the checkpoint of S
  is saved after the bad update, with the bad LR in its optimizer state;
- ``lr_spike_repeat:S``: every time the run passes step S the LR is set to 1000x the base LR (a
  schedule bug so large that a rollback's lower LR, held in each step, x0.125 after three, does not
  help);
- ``degrade:S``: ``lr_spike:S``, and after the first rollback 8 labels of every batch are wrong
  (the loss settles about 1.4x higher, no spike);
- ``bad_batch:S``: the batch of step S is a hard one (3% of its labels wrong: its loss about 4x),
  once; the run recovers on its own;
- ``nan:S``: a weight turns NaN at the start of step S, once (an update that got past the step
  guard: a fault of the device or of an in-place op): the loss and the gradients are NaN from step S
  until a rollback restores the weights;
- ``nan_batch:S``: the batch numbered S holds a NaN, every time it is trained on (a corrupt sample:
  replaying the batch replays the fault); the step guard skips its update;
- ``nan_from:S``: every batch from S on holds a NaN (no rollback can cure it).

``--no-guard`` turns the step guard off (``rw.watch(guard=False)``). ``--schedule cosine`` sets the
LR through a ``LambdaLR`` scheduler stepped every step. A rollback's ``skip_steps`` move the data
position past the window (the batch of step s is batch ``s + offset``), as docs/rollback.md shows.

``--exit-on-stop kill``: after an applied stop the process ends at once, as a preempted or killed job
does (no run_end, no exit handlers), once result.json is written.

``result.json`` in ``--out``: status, the actions applied, the losses of the final timeline, the
LR every update used (read inside ``optimizer.step()``, after runwatch's hold) and the LR the loop's
schedule set, the batch each step trained on, the steps whose weights held a non-finite value, the
updates the guard skipped, the validation loss at the end (held-out batches), the base LR.
The library's INFO log (each applied action) goes to stderr, as a
trainer that logs at INFO would show it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from runwatch.producer import ActionListener, RunWatch, save_checkpoint
from runwatch.producer.publish.lr_hold import held_scale

BASE_LR = 0.1


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fault", default="none")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.01)
    p.add_argument("--exit-on-stop", choices=("return", "kill"), default="return")
    p.add_argument("--no-guard", action="store_true")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    p.add_argument(
        "--label-noise", type=float, default=0.0, help="share of random labels in every batch (a loss floor)"
    )
    return p.parse_args()


def validation_loss(model: nn.Module, label_noise: float) -> float:
    with torch.no_grad():
        held_out = [batch(b, corrupt=label_noise) for b in VAL_BATCHES]
        return sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in held_out) / len(held_out)


VAL_BATCHES = range(100_000, 100_004)  # held out: no training step uses these batch ids
TEACHER = torch.nn.Linear(32, 8)
with torch.no_grad():
    TEACHER.weight.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(7)))


def batch(batch_id: int, corrupt: float = 0.0, wrong: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``corrupt``: a share of the labels replaced by random ones; ``wrong``: a share set to a wrong class."""
    g = torch.Generator().manual_seed(batch_id)
    x = torch.randn(2048, 32, generator=g)
    with torch.no_grad():
        y = TEACHER(x).argmax(dim=1)
    if corrupt > 0:
        flip = torch.rand(len(y), generator=g) < corrupt
        y = torch.where(flip, torch.randint(0, 8, y.shape, generator=g), y)
    if wrong > 0:
        y = torch.where(torch.arange(len(y)) < int(wrong * len(y)), (y + 1) % 8, y)
    return x, y


def main() -> int:
    args = parse()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("runwatch").setLevel(logging.INFO)
    kind, _, at = args.fault.partition(":")
    fault_step = int(at) if at else -1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        )
        if args.schedule == "cosine"
        else None
    )
    result: dict = {
        "applied": [],
        "losses": {},
        "lrs": {},
        "schedule_lrs": {},
        "batches": {},
        "nonfinite_weights": [],
        "base_lr": BASE_LR,
        "status": "completed",
    }
    out = args.out / "result.json"

    with RunWatch(args.run_id, bootstrap=args.bootstrap, spool=False) as rw:
        watch = rw.watch(model, optimizer, heartbeat_s=0.5, guard=not args.no_guard)
        listener = ActionListener(rw, model, optimizer, heartbeat=watch.heartbeat)
        used_lr: list[float] = []  # read inside step(), after runwatch's hooks: the LR the update used
        optimizer.register_step_pre_hook(lambda o, _a, _k: used_lr.append(float(o.param_groups[0]["lr"])))
        listener.wait_ready(30)
        step, faulted, last_rollback_at, data_offset = 0, False, None, 0
        while step < args.steps:
            stop = False
            for applied in listener.poll(step):
                result["applied"].append(
                    {
                        "kind": applied.kind,
                        "outcome": applied.outcome,
                        "at": step,
                        "to_step": applied.to_step,
                        "detail": applied.detail,
                        "lr_scale": applied.lr_scale,
                        "lr_after": optimizer.param_groups[0]["lr"] * held_scale(optimizer),
                        "skip": applied.skip_steps,
                    }
                )
                if applied.kind == "rollback" and applied.outcome == "applied":
                    if applied.skip_steps:  # the data goes on forward (docs/rollback.md)
                        data_offset += applied.skip_steps[1] - applied.skip_steps[0] + 1
                    step = applied.to_step + 1
                    last_rollback_at = step
                elif applied.kind == "stop":
                    stop = True
            if stop:
                result["status"] = "stopped"
                if args.exit_on_stop == "kill":
                    result["ignored"] = dict(listener.ignored)
                    out.write_text(json.dumps(result))
                    os._exit(137)  # killed: no run_end, no exit handlers
                break
            if scheduler is not None:  # the scheduler sets this step's LR (a rollback rewinds it)
                scheduler.last_epoch = step - 1
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # ("lr_scheduler.step() before optimizer.step()")
                    scheduler.step()
            batch_id = step + data_offset
            hard = kind == "bad_batch" and step == fault_step and not faulted
            faulted = faulted or hard
            wrong = 0.03 if hard else 0.0  # a hard batch: loss about 4x
            if kind == "degrade" and last_rollback_at is not None:
                wrong = 0.004  # 8 wrong labels in every batch from now on: loss about 1.4x, never 2x
            x, y = batch(batch_id, corrupt=args.label_noise, wrong=wrong)
            if kind == "nan" and step == fault_step and not faulted:
                faulted = True
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            tied = (
                batch_id == fault_step
                if kind == "nan_batch"
                else kind == "nan_from" and batch_id >= fault_step
            )
            if tied:
                x[0, 0] = float("nan")
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if kind in ("lr_spike", "degrade") and step == fault_step and not faulted:
                faulted = True
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * 50  # the bug: applied in this step's update
            if kind == "lr_spike_repeat" and step == fault_step:
                for group in optimizer.param_groups:
                    group["lr"] = (
                        BASE_LR * 1000
                    )  # a schedule bug: whatever the LR was, 1000x the base from here
            result["schedule_lrs"][step] = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad()
            watch.end_step(loss, step=step, samples=len(x))
            result["losses"][step] = float(loss)
            result["lrs"][step] = used_lr[-1]
            result["batches"][step] = batch_id
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                result["nonfinite_weights"].append(step)
            if step > 0 and step % args.checkpoint_every == 0:
                path = args.out / f"ckpt-{step}.pt"
                save_checkpoint(str(path), model, optimizer)
                rw.checkpoint(step, str(path))
            step += 1
            time.sleep(args.step_sleep)
        listener.close()
    result["lr"] = used_lr[-1] if used_lr else optimizer.param_groups[0]["lr"]
    result["ignored"] = dict(listener.ignored)
    result["skipped"] = dict(watch.guard.skipped) if watch.guard is not None else None
    result["val_loss"] = validation_loss(model, args.label_noise)
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
