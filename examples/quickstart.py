"""The README's training loop, complete: a small classifier on synthetic data in three "languages",
watched by runwatch. Run it against `runwatch up` (in another shell):

    source .runwatch/env    # RUNWATCH_BOOTSTRAP and RUNWATCH_ACTION_PUBLIC_KEYS, as `runwatch up` printed
    python examples/quickstart.py

At step 70 one batch is corrupted (a NaN in its inputs, as a bad record would): its loss and gradient
are NaN, and `rw.watch`'s step guard skips that update before it lands, so the weights never hold a NaN;
the worker sees the NaN step and alerts. (A NaN that persists, or got into the weights past the guard,
is rolled back to the newest checkpoint confirmed good, at half the LR.) Then `runwatch runs`,
`runwatch report quickstart-...` or the local page show what happened.
"""

from __future__ import annotations

import argparse
import math
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from runwatch.producer import ActionListener, RunWatch, category_loss, save_checkpoint

LANGUAGES = ["en", "de", "fr"]  # the categories: each batch's samples are split among them


def batches(seed: int, batch_size: int = 64, corrupt: int | None = None):
    """An endless stream of (x, y, language) batches: 3 classes, one input shift per language. The
    batch number ``corrupt`` holds a NaN, as a bad record would."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 16, generator=g) * 2.0
    shift = torch.randn(len(LANGUAGES), 16, generator=g) * 0.3
    n = 0
    while True:
        y = torch.randint(0, 3, (batch_size,), generator=g)
        language = torch.randint(0, len(LANGUAGES), (batch_size,), generator=g)
        x = centers[y] + shift[language] + torch.randn(batch_size, 16, generator=g)
        if n == corrupt:
            x[0, 0] = math.nan
        n += 1
        yield x, y, language


def evaluate(model: nn.Module, seed: int) -> tuple[float, float, dict[str, float]]:
    """Validation loss, accuracy and loss per language, on one held-out batch."""
    x, y, language = next(batches(seed + 1, batch_size=512))
    with torch.no_grad():
        logits = model(x)
        per_sample = nn.functional.cross_entropy(logits, y, reduction="none")
    per_language = category_loss(per_sample, language, names=LANGUAGES)
    accuracy = float((logits.argmax(1) == y).float().mean())
    return float(per_sample.mean()), accuracy, per_language


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", default=f"quickstart-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault-step", type=int, default=70, help="the corrupted batch (0: none)")
    parser.add_argument("--checkpoints", type=Path, default=Path(".runwatch/checkpoints"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss(reduction="none")  # per sample, for the per-language losses
    ckpt = args.checkpoints / args.run_id
    ckpt.mkdir(parents=True, exist_ok=True)
    loader = batches(seed=0, corrupt=args.fault_step or None)
    print(f"run {args.run_id}: {args.steps} steps, a corrupted batch at step {args.fault_step}")

    # The bootstrap comes from $RUNWATCH_BOOTSTRAP; config= is the run's own settings, stored with it.
    with RunWatch(args.run_id, config={"lr": 3e-3, "batch_size": 64}, seed=0, tags={"team": "docs"}) as rw:
        watch = rw.watch(model, optimizer, clip=1.0, update_every=10)  # runwatch clips: no clip_grad_norm_
        listener = ActionListener(rw, model, optimizer)  # verifies with $RUNWATCH_ACTION_PUBLIC_KEYS
        step = 0
        for x, y, language in watch.data(loader):  # times the wait for each batch
            per_sample = loss_fn(model(x), y)
            loss = per_sample.mean()
            loss.backward()
            optimizer.step()  # the hooks measure (and clip) around the step
            optimizer.zero_grad()
            watch.end_step(
                loss,
                step=step,
                samples=len(x),
                category_loss=category_loss(per_sample.detach(), language, names=LANGUAGES),
            )
            if step % 20 == 0 and math.isfinite(loss.item()):
                with watch.phase("checkpoint"):  # the heartbeat says so; not counted as step time
                    save_checkpoint(str(ckpt / f"step-{step}.pt"), model, optimizer)
                rw.checkpoint(step, str(ckpt / f"step-{step}.pt"))  # with the LR it was saved at
            if step % 25 == 0:
                with watch.phase("eval"):
                    val_loss, accuracy, per_language = evaluate(model, seed=0)
                watch.eval(step, "val", val_loss, {"accuracy": accuracy}, per_category=per_language)
            stop = False
            for applied in listener.poll(step):  # never waits on the network
                print(f"step {step}: {applied.kind} {applied.outcome}: {applied.detail or ''}".rstrip(": "))
                if applied.kind == "rollback" and applied.outcome == "applied":
                    step = applied.to_step  # model, optimizer and LR were restored from it
                elif applied.kind == "stop":
                    stop = True
            if stop or step >= args.steps:
                break
            step += 1
            time.sleep(0.02)  # (a real step takes longer: a realistic pace for the worker)
    print(f"run {args.run_id} ended at step {step}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
