"""A real single-rank training run (an MLP classifier on CPU, SGD with momentum) with a fault, for
the rollback integration tests. Run as ``python fault_train.py --bootstrap B --run-id R --out DIR``.

It is instrumented as the README says (``RunWatch``, ``rw.watch``, ``ActionListener``, a checkpoint
every ``--checkpoint-every`` steps) and acts on what the worker sends. Faults (``--fault``):

- ``none``;
- ``lr_spike:S``: the LR is multiplied by 50 in step S (before its update, and it stays so), once:
  a replay after a rollback does not do it again. S is a checkpoint step, so the checkpoint of S
  is saved after the bad update, with the bad LR in its optimizer state;
- ``lr_spike_repeat:S``: every time the run passes step S the LR is set to 50x the base LR (a
  schedule bug: a rollback's lower LR does not help);
- ``degrade:S``: ``lr_spike:S``, and after the first rollback 8 labels of every batch are wrong
  (the loss settles about 1.4x higher, no spike);
- ``bad_batch:S``: the batch of step S is a hard one (3% of its labels wrong: its loss about 4x),
  once; the run recovers on its own;
- ``nan:S``: the batch of step S holds a NaN, once: the loss, the gradients and (after the update)
  the weights are NaN until a rollback restores them.

``--exit-on-stop kill``: after an applied stop the process ends at once, as a preempted or killed job
does (no run_end, no exit handlers), once result.json is written.

``result.json`` in ``--out``: status, the actions applied, the losses of the final timeline, the
LR of every step, the base LR. The library's INFO log (each applied action) goes to stderr, as a
trainer that logs at INFO would show it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from runwatch.producer import ActionListener, RunWatch, save_checkpoint

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
    return p.parse_args()


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
    result: dict = {"applied": [], "losses": {}, "lrs": {}, "base_lr": BASE_LR, "status": "completed"}
    out = args.out / "result.json"

    with RunWatch(args.run_id, bootstrap=args.bootstrap, spool=False) as rw:
        watch = rw.watch(model, optimizer, heartbeat_s=0.5)
        listener = ActionListener(rw, model, optimizer, heartbeat=watch.heartbeat)
        listener.wait_ready(30)
        step, faulted, last_rollback_at = 0, False, None
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
                        "lr_after": optimizer.param_groups[0]["lr"],
                    }
                )
                if applied.kind == "rollback" and applied.outcome == "applied":
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
            hard = kind == "bad_batch" and step == fault_step and not faulted
            faulted = faulted or hard
            wrong = 0.03 if hard else 0.0  # a hard batch: loss about 4x
            if kind == "degrade" and last_rollback_at is not None:
                wrong = 0.004  # 8 wrong labels in every batch from now on: loss about 1.4x, never 2x
            x, y = batch(step, wrong=wrong)
            if kind == "nan" and step == fault_step and not faulted:
                faulted = True
                x[0, 0] = float("nan")
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if kind in ("lr_spike", "degrade") and step == fault_step and not faulted:
                faulted = True
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * 50  # the bug: applied in this step's update
            if kind == "lr_spike_repeat" and step == fault_step:
                for group in optimizer.param_groups:
                    group["lr"] = BASE_LR * 50  # a schedule bug: whatever the LR was, 50x the base from here
            optimizer.step()
            optimizer.zero_grad()
            watch.end_step(loss, step=step, samples=len(x))
            result["losses"][step] = float(loss)
            result["lrs"][step] = optimizer.param_groups[0]["lr"]
            if step > 0 and step % args.checkpoint_every == 0:
                path = args.out / f"ckpt-{step}.pt"
                save_checkpoint(str(path), model, optimizer)
                rw.checkpoint(step, str(path))
            step += 1
            time.sleep(args.step_sleep)
        listener.close()
    result["lr"] = optimizer.param_groups[0]["lr"]
    result["ignored"] = dict(listener.ignored)
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
