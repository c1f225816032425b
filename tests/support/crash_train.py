"""A real training process that dies the way chosen by ``--death``, for tests/producer/test_crashes.py.
Run it under the launcher: ``runwatch launch --run-id R -- python crash_train.py --death D ...``.

Deaths: ``raise`` (an exception in the loop), ``segv`` (SIGSEGV), ``term`` (waits in the loop for the
test's SIGTERM), ``oom`` (an allocation over the address space the process limited itself to, as a host
under a memory limit refuses it).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import time

import torch
from torch import nn

from runwatch.producer import RunWatch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-id", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--death", required=True, choices=["raise", "segv", "term", "oom"])
    p.add_argument("--at-step", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RunWatch(args.run_id, bootstrap=args.bootstrap, spool=False, job_id="4242")
    step = 0
    while True:
        x = torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rw.step(step, loss=loss.item())
        if step == args.at_step:
            print(f"crash_train: dying by {args.death} at step {step}", flush=True)
            if args.death == "raise":
                raise ValueError(f"bad batch at step {step}: shapes do not match")
            if args.death == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if args.death == "oom":
                with open("/proc/self/status") as f:
                    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
                limit = vm + (512 << 20)
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                torch.empty(8 << 30, dtype=torch.uint8).fill_(1)  # 8 GiB over a limit of +512 MiB
        if args.death == "term" and step >= args.at_step:
            print("crash_train: waiting for SIGTERM", flush=True)
            time.sleep(0.2)
        step += 1
        time.sleep(0.05)


if __name__ == "__main__":
    main()
