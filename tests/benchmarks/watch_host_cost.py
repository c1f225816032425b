"""runwatch's own host cost per training step, on any machine (the figure to track without a GPU).

A model of 150 tiny parameter tensors (75 ``Linear(16, 16)``) makes the tensor work negligible, so
what is timed is host work: Python, op dispatch, the publisher's encoding and sending. Per step:

- ``calls_us``: time inside runwatch's calls (``before_optimizer_step``, ``after_optimizer_step``,
  ``end_step``; the first clips, so the bare loop's ``clip_grad_norm_`` is timed too, as ``clip_us``);
- ``background_cpu_us``: CPU time of the threads runwatch starts (publisher, Kafka client, heartbeat)
  per event, measured with per-thread CPU clocks: they hold the GIL while they run;
- ``host_us`` = ``calls_us - clip_us + background_cpu_us``: what runwatch adds to a loop that clips;
- ``tensor_ops`` / ``clip_ops``: aten operations runwatch's calls issue per step (a step that measures
  update norms, and one that does not), against ``clip_grad_norm_``'s.

Used by ``bench_watch_overhead.py --host`` and ``watch_host_cost_compare.py``; on its own it prints one
``measure`` as JSON (``--bootstrap``: a broker's; default an embedded one started here)::

    .venv/bin/python tests/benchmarks/watch_host_cost.py [--bootstrap HOST:PORT] [--steps 1000]
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runwatch.producer import RunWatch

N_TENSORS = 150


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(N_TENSORS // 2)])


def _thread_cpu_s(threads: list[threading.Thread]) -> float:
    return sum(_threads_cpu_s(threads).values())


def _threads_cpu_s(threads: list[threading.Thread]) -> dict[str, float]:
    """CPU seconds of each thread by its role (the name less the run's own prefix)."""
    out: dict[str, float] = {}
    for t in threads:
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
        except (OSError, TypeError, ProcessLookupError):
            continue  # the thread ended
        role = t.name.rsplit("-r0-", 1)[-1]
        out[role] = out.get(role, 0.0) + cpu
    return out


def _time_calls(watch: Any, names: tuple[str, ...]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        original = getattr(watch, name)

        def timed(
            *args: Any, _original: Any = original, _out: list[float] = times[name], **kwargs: Any
        ) -> Any:
            t = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                _out.append(time.thread_time() - t)

        setattr(watch, name, timed)
    return times


def count_ops(update_every: int = 10) -> dict[str, Any]:
    """aten ops per step inside runwatch's calls (update step and plain step) and inside clip_grad_norm_."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    with tempfile.TemporaryDirectory() as spool:
        from runwatch.producer import JsonlRecorder

        rw = JsonlRecorder(f"{spool}/events.jsonl", "bench-ops", collect_metadata=False)
        watch = rw.watch(
            model, opt, clip=1.0, update_every=update_every, heartbeat_s=None, memory=False, hooks=False
        )
        counts = []
        for step in range(2):
            model(x).square().mean().backward()
            counter = OpCounter()
            with counter:
                watch.before_optimizer_step()
            opt.step()
            with counter:
                watch.after_optimizer_step()
                watch.end_step(torch.tensor(1.0))
            opt.zero_grad(set_to_none=True)
            counts.append(counter.ops)
            del step
        rw.close()
    model(x).square().mean().backward()
    clip = OpCounter()
    with clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return {
        "update_step": sum(counts[0].values()),
        "plain_step": sum(counts[1].values()),
        "clip_grad_norm_": sum(clip.ops.values()),
        "plain_step_ops": dict(counts[1]),
    }


def measure(bootstrap: str, steps: int = 2000, update_every: int = 10) -> dict[str, Any]:
    """Host time per step of a watched loop over ``tiny_model``; events go to Kafka at ``bootstrap``."""
    model, bare = tiny_model(0), tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    bare_opt = torch.optim.SGD(bare.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    before = set(threading.enumerate())
    with tempfile.TemporaryDirectory() as spool:
        rw = RunWatch(f"bench-host-{time.time_ns()}", bootstrap, spool_dir=spool)
        watch = rw.watch(model, opt, clip=1.0, update_every=update_every, heartbeat_s=5.0)
        calls = _time_calls(watch, ("before_optimizer_step", "after_optimizer_step", "end_step"))
        clip_times: list[float] = []
        warmup = 50
        threads: list[threading.Thread] = []
        cpu0: dict[str, float] = {}
        for i in range(warmup + steps):
            if i == warmup:
                threads = [t for t in threading.enumerate() if t not in before]
                cpu0 = _threads_cpu_s(threads)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.end_step(loss, samples=4)
            bare(x).square().mean().backward()
            t = time.thread_time()
            torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
            clip_times.append(time.thread_time() - t)
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=True)
        watch.close()
        deadline = time.monotonic() + 60  # let the publisher finish what the loop gave it
        stats = rw.stats
        while time.monotonic() < deadline and stats.published + stats.spooled + stats.dropped < stats.queued:
            time.sleep(0.05)
        cpu1 = _threads_cpu_s(threads)
        stats = rw.close(timeout=30)
    per_call = {name: statistics.fmean(t[warmup:]) * 1e6 for name, t in calls.items() if len(t) > warmup}
    # means over all steps: the update steps' extra cost is spread over them
    calls_us = sum(per_call.values())
    clip_us = statistics.fmean(clip_times[warmup:]) * 1e6
    by_thread = {role: (cpu1[role] - cpu0.get(role, 0.0)) / steps * 1e6 for role in cpu1}
    background = sum(by_thread.values())
    return {
        "steps": steps,
        "calls_us": round(calls_us, 1),
        "per_call_us": {name: round(v, 1) for name, v in per_call.items()},
        "clip_us": round(clip_us, 1),
        "background_cpu_us": round(background, 1),
        "background_by_thread_us": {role: round(v, 1) for role, v in sorted(by_thread.items())},
        "host_us": round(calls_us - clip_us + background, 1),
        "threads": sorted(t.name for t in threads),
        "published": stats.published,
        "spooled": stats.spooled,
        "dropped": stats.dropped,
    }


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="runwatch's host time per step on the 150-tensor model (JSON)")
    ap.add_argument("--bootstrap", help="a broker's bootstrap address (default: an embedded broker)")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    if args.bootstrap:
        print(json.dumps(measure(args.bootstrap, steps=args.steps)))
        return
    from runwatch.local.broker import EmbeddedBroker, ensure_topics

    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap)
        print(json.dumps(measure(broker.bootstrap, steps=args.steps)))


if __name__ == "__main__":
    main()
