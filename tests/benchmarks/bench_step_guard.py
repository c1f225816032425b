"""What the step guard (issue 37) costs the trainer's host, per step, and what the LR hold costs.

The 150-tensor model of ``watch_host_cost.py`` (the tensor work is negligible: what is timed is host
work). Arms, interleaved in blocks on one process so that a busy machine slows all of them alike:

- ``off``: ``rw.watch(guard=False)``, no rollback scale held;
- ``guard``: the default ``rw.watch`` (the guard judges every step: one read of two numbers from the
  device, a median of the last 100 norms);
- ``guard_held``: the guard, and a rollback's LR scale held in every step (``LRHold``: a pre-hook and a
  post-hook on the optimizer).

Each block times ``steps`` whole training steps (forward, backward, ``optimizer.step()`` with the hooks,
``end_step``), one ``time.perf_counter`` at each end; and, apart, the watcher's pre-update call alone
(``before_optimizer_step``, where the guard judges), summed over the block's steps with the thread's
CPU clock. Prints JSON: per arm the median over blocks of the microseconds per step (whole step, and the
pre-update call), and the guard's and the hold's added microseconds (medians of the per-block
differences against ``off``).

    python tests/benchmarks/bench_step_guard.py [--blocks 9] [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from watch_host_cost import tiny_model  # (beside this file: run as a script)

from runwatch.producer import RunWatch
from runwatch.producer.instrument.gradstats import ParamLayout, grad_norms
from runwatch.producer.instrument.guard import StepGuard
from runwatch.producer.publish.delivery import MemoryDelivery
from runwatch.producer.publish.lr_hold import LRHold

ARMS = ("off", "guard", "guard_held")


def block(arm: str, steps: int) -> tuple[float, float]:
    """Microseconds per step of ``steps`` training steps in ``arm``, and of its pre-update call."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rw = RunWatch("bench-guard", "unused:9092", collect_metadata=False, delivery=MemoryDelivery())
    watch = rw.watch(model, optimizer, heartbeat_s=None, memory=False, guard=arm != "off", update_every=10)
    if arm == "guard_held":
        hold = LRHold.of(optimizer)
        assert hold is not None
        hold.hold(0.5)
    x = torch.randn(8, 16)
    for _ in range(30):  # warm: the guard past its warm-up, the allocator settled
        _step(model, optimizer, watch, x)
    calls = [0.0]
    original = watch.before_optimizer_step

    def timed() -> None:
        t = time.thread_time()
        original()
        calls[0] += time.thread_time() - t

    watch.before_optimizer_step = timed  # (the hook calls it through the instance)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, optimizer, watch, x)
    elapsed = time.perf_counter() - start
    watch.close()
    rw.close(timeout=1)
    return elapsed / steps * 1e6, calls[0] / steps * 1e6


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, watch, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    watch.end_step(loss)


def guard_alone_us(calls: int = 20000) -> dict[str, float]:
    """The guard's own work per step, without the rest of the step: the two numbers read from the device
    (a CPU tensor here: no sync to wait for) and the judgement."""
    model = tiny_model()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    grad = grad_norms(ParamLayout(model), None, apply_clip=False)
    assert grad is not None
    guard = StepGuard()
    start = time.perf_counter()
    for _ in range(calls):
        norm, nonfinite = grad.figures[-1].item(), grad.nonfinite.item()
    read = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        guard.judge(norm, nonfinite)
    judge = time.perf_counter() - start
    return {"read_us": round(read / calls * 1e6, 2), "judge_us": round(judge / calls * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    pre: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.blocks):
        for arm in ARMS:
            step_us, pre_us = block(arm, args.steps)
            times[arm].append(step_us)
            pre[arm].append(pre_us)

    def added(series: dict[str, list[float]]) -> dict[str, float]:
        return {
            arm: round(statistics.median(t - o for t, o in zip(series[arm], series["off"], strict=True)), 1)
            for arm in ARMS[1:]
        }

    print(
        json.dumps(
            {
                "us_per_step": {arm: round(statistics.median(v), 1) for arm, v in times.items()},
                "added_us_per_step": added(times),
                "pre_update_call_us": {arm: round(statistics.median(v), 1) for arm, v in pre.items()},
                "pre_update_call_added_us": added(pre),
                "ratio_to_off": {
                    arm: round(statistics.median(times[arm]) / statistics.median(times["off"]), 3)
                    for arm in ARMS[1:]
                },
                "guard_alone": guard_alone_us(),
                "blocks": args.blocks,
                "steps": args.steps,
                "device": "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
