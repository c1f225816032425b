"""Seeded watched training runs recorded to JSONL, to compare what two versions of runwatch publish.

Only the public API (``JsonlRecorder``, ``rw.watch``, ``watch.end_step``...), so that the script of this
checkout can drive an earlier commit's runwatch (its rooms first on ``PYTHONPATH``), as
``watch_host_cost_compare.py`` and ``tests/producer/test_watch_events_unchanged.py`` do. Everything that
varies from run to run is fixed: the seeds, a simulated step clock, the events' ``ts`` clock, no memory
sampling (its figures are the process's), no heartbeat thread. What is left to differ between two
versions is what they compute and publish; ``event_id`` and ``ts`` are dropped by :func:`comparable`.

    python tests/benchmarks/record_seeded_run.py OUT_DIR      # writes OUT_DIR/<run>.jsonl, one per run
"""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runwatch.producer import JsonlRecorder

os.environ["RUNWATCH_ATTEMPT"] = "seeded"  # (else rank 0 names a new random attempt in run_start)

N_TENSORS = 150
STEPS = 40


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(N_TENSORS // 2)])


class _Clock:
    """A simulated clock: each call is 1 ms later (the step clock), or a fixed start plus a counter."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def _ts_clock() -> Any:
    start, n = datetime(2026, 1, 1, tzinfo=UTC), [0]

    def now() -> datetime:
        n[0] += 1
        return start + timedelta(milliseconds=n[0])

    return now


def _loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    scale = 30.0 if step % 5 == 0 else 1.0  # every fifth step's gradient is clipped
    loss = model(x).square().mean() * scale
    if step == 17:
        loss = loss * float("nan")  # a non-finite step: the guard skips it
    return loss


class _FileClient:
    """kafka-python's ``KafkaProducer`` as ``KafkaDelivery`` uses it: each record's value is appended to a
    file (one JSON line, as the JSONL recorder writes) and acknowledged at once."""

    def __init__(self, path: Path):
        self._file = path.open("wb")
        self._offset = 0

    def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def send(self, topic: str, key: Any = None, value: Any = None, timestamp_ms: Any = None, **_: Any) -> Any:
        from kafka.future import Future
        from kafka.producer.future import RecordMetadata

        self._file.write(value + b"\n")
        self._offset += 1
        future = Future()
        return future.success(
            RecordMetadata(topic, 0, None, self._offset, timestamp_ms, None, 0, len(value), -1)
        )

    def flush(self, timeout: Any = None) -> None:
        self._file.flush()

    def close(self, timeout: Any = None) -> None:
        self._file.close()


def _kafka_recorder(path: Path, run_id: str) -> Any:
    """A ``RunWatch`` whose Kafka delivery (its publisher thread, batches and all) hands records to a
    :class:`_FileClient`: what the default path publishes, with no broker."""
    from runwatch.producer import RunWatch
    from runwatch.producer.publish.kafka_delivery import KafkaDelivery

    class FileDelivery(KafkaDelivery):
        def _make_producer(self) -> Any:
            return _FileClient(path)

    delivery = FileDelivery(run_id, 0, "127.0.0.1:1", spool_path=None)
    return RunWatch(run_id, "127.0.0.1:1", delivery=delivery, clock=_ts_clock(), collect_metadata=False)


def run_with_optimizer(path: Path, through_kafka: bool = False) -> None:
    """The hooks path: ``clip=``, the guard, update norms every 3 steps, activations, replica digests,
    an eval and a checkpoint phase, samples and tokens."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    rec: Any = (
        _kafka_recorder(path, "seeded-opt")
        if through_kafka
        else JsonlRecorder(path, "seeded-opt", clock=_ts_clock(), collect_metadata=False)
    )
    watch = rec.watch(
        model,
        opt,
        clip=1.0,
        update_every=3,
        memory=False,
        clock=_Clock(),
        activations=True,
        activations_every=4,
        replicas=True,
        fingerprint_every=7,
        flops_per_step=1e6,
        peak_flops_per_s=1e9,
    )
    for step in range(STEPS):
        loss = _loss(model, x, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 9:
            with watch.phase("eval"):
                watch.eval(step, loss=float(loss.detach()), metrics={"acc": 0.5})
        watch.end_step(loss, samples=4, tokens=64)
    rec.close()


def run_by_hand(path: Path) -> None:
    """A hand-written update (``optimizer=None``): the two calls around it, ``external_clip``, an LR per
    step, a float loss on some steps."""
    model = _model(2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    rec = JsonlRecorder(path, "seeded-hand", clock=_ts_clock(), collect_metadata=False)
    watch = rec.watch(model, None, lr=0.05, external_clip=2.0, update_every=4, memory=False, clock=_Clock())
    for step in range(STEPS):
        model.zero_grad()
        loss = _loss(model, x, step)
        loss.backward()
        watch.before_optimizer_step()
        if not watch.should_skip():
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.05 * p.grad
        watch.after_optimizer_step()
        value: Any = float(loss.detach()) if step % 3 == 0 else loss
        watch.end_step(value, lr=0.05 * (1 + step % 2))
    rec.close()


def run_unguarded(path: Path) -> None:
    """No guard, no module norms, gradients read at ``end_step`` (no hooks), a loss of several values."""
    model = _model(4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    rec = JsonlRecorder(path, "seeded-unguarded", clock=_ts_clock(), collect_metadata=False)
    watch = rec.watch(model, opt, clip=0.5, guard=False, module_norms=False, memory=False, clock=_Clock())
    for step in range(STEPS):
        per_sample = model(x).square().mean(dim=1) * (20.0 if step % 4 == 0 else 1.0)
        per_sample.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.end_step(per_sample.detach(), samples=4)
    rec.close()


RUNS = {
    "optimizer": run_with_optimizer,
    "optimizer_kafka": lambda path: run_with_optimizer(path, through_kafka=True),
    "by_hand": run_by_hand,
    "unguarded": run_unguarded,
}


def record(out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, run in RUNS.items():
        paths[name] = out / f"{name}.jsonl"
        run(paths[name])
    return paths


def comparable(path: Path) -> list[dict[str, Any]]:
    """The events of a recording, without what differs by construction (``event_id``; ``ts`` is fixed
    here but dropped too), NaN as the string it travels as."""
    events = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        event.pop("event_id", None)
        event.pop("ts", None)
        events.append(event)
    return events


def differences(a: list[dict[str, Any]], b: list[dict[str, Any]], limit: int = 5) -> list[str]:
    """Where two recordings differ, field by field (empty: the same events)."""
    out = []
    if len(a) != len(b):
        out.append(f"{len(a)} events against {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        for key in sorted(set(x) | set(y)):
            if x.get(key, "<absent>") != y.get(key, "<absent>") and not _both_nan(x.get(key), y.get(key)):
                out.append(
                    f"event {i} ({x.get('kind')} {x.get('step')}): {key}: {x.get(key)!r} != {y.get(key)!r}"
                )
                if len(out) >= limit:
                    return out
    return out


def _both_nan(x: Any, y: Any) -> bool:
    return isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)


if __name__ == "__main__":
    for name, path in record(Path(sys.argv[1])).items():
        print(name, len(path.read_text().splitlines()), "events", file=sys.stderr)
