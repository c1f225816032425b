"""What the replicas' parameter fingerprint (issue 38, ``rw.watch(replicas=True)``) costs a training step.

Two measurements on one process:

- the fingerprint alone: ``ReplicaFingerprint.values`` (the per-tensor integer sums of the bits and their
  two combinations, on the device) plus its share of the step's host copy and ``digest``, timed over many
  calls; divided by ``every`` (50), it is the cost per step, and its ratio to a step of the same model is
  the figure docs/benchmarks.md quotes;
- whole steps, interleaved blocks with the fingerprint off and on (``fingerprint_every`` 50), one
  ``time.perf_counter`` (and, on CUDA, one sync) at each end of a block: the ratio of the medians.

The model is ``watch_host_cost.py``'s 150-tensor one, or ``--width`` for a larger one (bigger tensors: the
sums read every byte once). Prints JSON.

    python tests/benchmarks/bench_replica_fingerprint.py [--blocks 9] [--steps 400] [--device cuda]
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
from runwatch.producer.instrument.fingerprint import ReplicaFingerprint
from runwatch.producer.publish.delivery import MemoryDelivery

EVERY = 50


def make_model(width: int, device: str) -> nn.Module:
    if width <= 0:
        return tiny_model().to(device)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(nn.Linear(16, width), *layers, nn.Linear(width, 1)).to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def block(on: bool, steps: int, width: int, device: str) -> float:
    """Microseconds per step of ``steps`` training steps with the fingerprint ``on`` (every 50) or off."""
    model = make_model(width, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rw = RunWatch("bench-fingerprint", "unused:9092", collect_metadata=False, delivery=MemoryDelivery())
    watch = rw.watch(model, optimizer, heartbeat_s=None, memory=False, replicas=on, fingerprint_every=EVERY)
    x = torch.randn(8, 16, device=device)
    for _ in range(30):
        _step(model, optimizer, watch, x)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, optimizer, watch, x)
    _sync(device)
    elapsed = time.perf_counter() - start
    watch.close()
    rw.close(timeout=1)
    return elapsed / steps * 1e6


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, watch, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    watch.end_step(loss)


def fingerprint_alone_us(width: int, device: str, calls: int = 500) -> float:
    """One fingerprint: the device work, the copy of its 4 values and the digest, in microseconds."""
    model = make_model(width, device)
    fingerprint = ReplicaFingerprint(list(model.parameters()), 1)
    for _ in range(10):
        ReplicaFingerprint.digest(fingerprint.values(0).double().cpu().tolist())  # type: ignore[union-attr]
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        halves = fingerprint.values(0)
        assert halves is not None
        ReplicaFingerprint.digest(halves.double().cpu().tolist())
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--width", type=int, default=0, help="0: the 150-tensor model; else 10 layers this wide")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.blocks):
        times["off"].append(block(False, args.steps, args.width, args.device))
        times["on"].append(block(True, args.steps, args.width, args.device))
    step_us = statistics.median(times["off"])
    alone = fingerprint_alone_us(args.width, args.device)
    model = make_model(args.width, args.device)
    print(
        json.dumps(
            {
                "us_per_step": {arm: round(statistics.median(v), 1) for arm, v in times.items()},
                "ratio_on_to_off": round(statistics.median(times["on"]) / step_us, 4),
                "fingerprint_us": round(alone, 1),
                "fingerprint_us_per_step_at_every_50": round(alone / EVERY, 2),
                "share_of_step_at_every_50": round(alone / EVERY / step_us, 5),
                "tensors": len(list(model.parameters())),
                "parameters": sum(p.numel() for p in model.parameters()),
                "blocks": args.blocks,
                "steps": args.steps,
                "device": args.device,
            }
        )
    )


if __name__ == "__main__":
    main()
