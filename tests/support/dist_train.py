"""One rank of a real multi-process training run (torch.distributed, gloo, DDP on CPU) for the
multi-rank integration tests. Run as ``python dist_train.py --rank R --world W --port P ...``.

Each rank publishes through ``RunWatch`` + ``rw.watch`` to the real broker and acts on actions
with an ``ActionListener`` (synchronised across ranks). Faults, chosen by ``--fault``:

- ``none``: a healthy run; with ``--shard`` every rank measures only its round-robin shard of the
  parameters (partial norms), and rank 0 writes the norm of the full gradient of each step;
- ``slow:R:S``: rank R sleeps S seconds before each forward (a straggler);
- ``long_checkpoint:STEP:S``: rank 0's checkpoint at STEP takes S seconds longer;
- ``hang:R:STEP``: rank R stops before the forward of STEP and sleeps (its heartbeat goes on);
- ``hang_before_allreduce:R:STEP``: every rank all-reduces its loss (for its log) after each update, and
  rank R sleeps right before that collective at STEP, so its peers wait inside ``all_reduce``;
- ``kill:R:STEP``: rank R SIGKILLs itself at STEP; the others wait, heartbeating, as ranks stuck
  in a collective do;
- ``bad_batch:B``: the batch numbered B makes the gradients explode (skipping it cures the run);
- ``bad_step:STEP``: every pass through STEP explodes (a rollback cannot cure it);
- ``flip:R:STEP``: before the forward of STEP, rank R flips the lowest exponent bit of one element of its
  first parameter (silent data corruption: the value halves or doubles, nothing goes non-finite);
- ``rank_loss:R:BATCH:N:F``: rank R's loss (and so its gradients) is F times larger on the N batches from
  BATCH (one rank's bad data; skipping the batches cures it).

GPU health: with ``RUNWATCH_TEST_FAKE_NVML=R`` in the environment (read by this script only) every rank's
heartbeats carry ``gpu`` from a fake NVML (fake_nvml.py here), and rank R's reports its SM clock capped
with the thermal throttle reason (there is no GPU here).

Each rank writes ``result-R.json`` in ``--out``: its status, the actions it applied, final LR.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from runwatch.producer import RunWatch
from runwatch.producer.actions.checkpoints import save_checkpoint
from runwatch.producer.actions.listener import ActionListener
from runwatch.producer.publish.lr_hold import held_scale

STOP_EXIT_CODE = 3
BASE_LR = 0.05


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fault", action="append", default=[], help="KIND:ARGS (repeatable)")
    p.add_argument("--shard", action="store_true")
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds of extra work per step (real steps are slow)"
    )
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--stop-exit-after-s", type=float, default=2.0)
    p.add_argument("--no-guard", action="store_true", help="rw.watch(guard=False)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--noise", type=float, default=0.0, help="the targets' noise (a loss floor)")
    return p.parse_args()


def batch(batch_id: int, rank: int, size: int = 32, noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``noise``: the targets' own noise (a loss floor, as real data has; without it the loss goes to 0 and
    the ranks' losses differ by orders of magnitude by chance)."""
    g = torch.Generator().manual_seed(1000 * batch_id + rank)
    x = torch.randn(size, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True)
    if noise:
        y = y + noise * torch.randn(size, 1, generator=g)
    return x, y


def fake_gpu_health(rank: int) -> object:
    """``rw.watch``'s ``gpu_health``: a sampler over a fake NVML where RUNWATCH_TEST_FAKE_NVML names the
    throttled rank, else True (the default: none on this CPU model)."""
    throttled = os.environ.get("RUNWATCH_TEST_FAKE_NVML")
    if not throttled:
        return True
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fake_nvml import SW_THERMAL, FakeDevice, FakeNvml

    from runwatch.producer.instrument.gpu_health import GpuHealthSampler

    device = (
        FakeDevice(sm_clock=1110, reasons=SW_THERMAL, temperature=91)
        if rank == int(throttled)
        else FakeDevice()
    )
    return GpuHealthSampler(0, cuda_device=0, nvml=FakeNvml({0: device}))


def main() -> int:
    args = parse()
    faults = {kind: params for kind, *params in (f.split(":") for f in args.fault)}
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    names = [name for name, _ in ddp.named_parameters()]
    shard = {n for i, n in enumerate(names) if i % args.world == args.rank} if args.shard else None

    rw = RunWatch(args.run_id, bootstrap=args.bootstrap, rank=args.rank, world_size=args.world, spool=False)
    watch = rw.watch(
        ddp,
        optimizer,
        heartbeat_s=0.5,
        update_every=0,
        shard=shard,
        guard=not args.no_guard,
        gpu_health=fake_gpu_health(args.rank),
    )
    listener = ActionListener(
        rw,
        model,
        optimizer,
        heartbeat=watch.heartbeat,
        stop_exit_after_s=args.stop_exit_after_s,
        stop_exit_code=STOP_EXIT_CODE,
    )
    listener.wait_ready(30)
    dist.barrier()

    result: dict = {"rank": args.rank, "applied": [], "full_grad_norms": {}, "status": "completed"}
    result["consuming"] = listener.consuming  # (under rank sync, one rank per node reads the action topic)
    out = args.out / f"result-{args.rank}.json"

    def write() -> None:
        result["lr"] = optimizer.param_groups[0]["lr"] * held_scale(optimizer)  # (the LR an update uses)
        result["weights"] = hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        ).hexdigest()
        result["skipped_steps"] = skipped_steps
        out.write_text(json.dumps(result))

    step, batch_id, skip = 0, 0, None
    skipped_steps: list[int] = []  # updates the step guard skipped
    try:
        while step < args.steps:
            applied_now = listener.poll(step)
            stop = False
            for applied in applied_now:
                result["applied"].append(
                    {
                        "kind": applied.kind,
                        "outcome": applied.outcome,
                        "at": step,
                        "to_step": applied.to_step,
                        "lr_scale": applied.lr_scale,
                        "skip": applied.skip_steps,
                    }
                )
                if applied.kind == "rollback" and applied.outcome == "applied":
                    step, skip = applied.to_step + 1, applied.skip_steps
                    batch_id = step  # replay the same data from there, except the window to skip
                elif applied.kind == "stop":
                    stop = True
            if stop:
                result["status"] = "stopped"
                break
            if skip is not None and skip[0] <= batch_id <= skip[1]:
                batch_id = skip[1] + 1
            x, y = batch(batch_id, args.rank, args.batch_size, args.noise)
            if "slow" in faults and args.rank == int(faults["slow"][0]):
                time.sleep(float(faults["slow"][1]))
            if "hang" in faults and args.rank == int(faults["hang"][0]) and step == int(faults["hang"][1]):
                write()
                time.sleep(600)  # hung: no step, the heartbeat thread goes on
            if "flip" in faults and args.rank == int(faults["flip"][0]) and step == int(faults["flip"][1]):
                with torch.no_grad():
                    bits = next(model.parameters()).view(-1)[:1].view(torch.int32)
                    bits ^= 1 << 23  # the exponent's lowest bit
            if "kill" in faults and args.rank == int(faults["kill"][0]) and step == int(faults["kill"][1]):
                os.kill(os.getpid(), signal.SIGKILL)
            loss = nn.functional.mse_loss(ddp(x), y)
            if ("bad_batch" in faults and batch_id == int(faults["bad_batch"][0])) or (
                "bad_step" in faults and step == int(faults["bad_step"][0])
            ):
                loss = loss * 1e6  # the gradients explode
            if "rank_loss" in faults and args.rank == int(faults["rank_loss"][0]):
                first, count, factor = (float(v) for v in faults["rank_loss"][1:])
                if first <= batch_id < first + count:
                    loss = loss * factor
            loss.backward()
            time.sleep(args.step_sleep)
            if args.shard and args.rank == 0:
                grads = [p.grad for p in ddp.parameters()]
                result["full_grad_norms"][step] = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g) for g in grads])
                ).item()
            optimizer.step()
            if watch.should_skip():
                skipped_steps.append(step)
            optimizer.zero_grad()
            if "hang_before_allreduce" in faults:
                culprit, at = (int(v) for v in faults["hang_before_allreduce"])
                logged = loss.detach().clone()
                if args.rank == culprit and step == at:
                    write()
                    time.sleep(600)  # HANG-BEFORE-ALLREDUCE: the peers wait in the all_reduce below
                dist.all_reduce(logged)
            watch.end_step(loss, step=step, samples=len(x))
            if args.rank == 0 and step > 0 and step % args.checkpoint_every == 0:
                with watch.phase("checkpoint"):
                    path = args.out / f"ckpt-{step}.pt"
                    save_checkpoint(str(path), model, optimizer)
                    if "long_checkpoint" in faults and step == int(faults["long_checkpoint"][0]):
                        time.sleep(float(faults["long_checkpoint"][1]))
                rw.checkpoint(step, str(path))
            step += 1
            batch_id += 1
    except RuntimeError as exc:  # a peer died inside a collective: wait as a stuck rank would
        result["status"] = "failed"
        result["error"] = repr(exc)
        write()
        time.sleep(120)  # the stop watchdog ends it (os._exit) once the worker's stop arrives
    write()
    watch.close()
    listener.close()
    rw.close(status=result["status"] if result["status"] != "failed" else "failed")
    result["published"], result["drop_reasons"] = (
        rw.stats.published,
        rw.stats.drop_reasons,
    )  # for a failure's message
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
