"""What the parts of bench_state.py share: the keys (new in each process), the partition count, the
bench's step events (many runs; 20 module norms, 8 categories, memory and timing, as
bench_throughput.py's) and a state reader with nothing stored."""

from __future__ import annotations

import math
import random
import secrets
import sys
from datetime import UTC, datetime, timedelta

from runwatch.contract import topics
from runwatch.contract.schema import CategoryLoss, MemoryStats, StepEvent
from runwatch.detectors import RunwatchConfig
from runwatch.worker.processor import TelemetryProcessor
from runwatch.worker.state.run_states import StateOptions

SECRET = secrets.token_bytes(32)
STATE_SECRET = secrets.token_bytes(32)  # the workers' state key (never the action secret)
PARTITIONS = 4


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def step_event(run: str, step: int, rng: random.Random, t0: datetime) -> StepEvent:
    """A healthy step of ``run`` (bench_throughput.py's events too)."""
    return StepEvent(
        run_id=run,
        step=step,
        ts=t0 + timedelta(seconds=0.2 * step),
        loss=2.0 * math.exp(rng.gauss(0, 0.05)),
        lr=[3e-4],
        grad_norm=1.0 + rng.random() * 0.1,
        module_grad_norms={f"layers.{k}": 0.1 + rng.random() * 0.01 for k in range(20)},
        category_loss={f"c{k}": CategoryLoss(mean=2.0 + rng.gauss(0, 0.05), count=16) for k in range(8)},
        step_time_s=0.2 * math.exp(rng.gauss(0, 0.05)),
        data_wait_s=0.01,
        samples_per_s=640.0,
        memory=MemoryStats(allocated=10**10, reserved=12 * 10**9, host_rss=8 * 2**30),
    )


def stream(runs: int, steps: int, seed: int = 0) -> list[tuple[bytes, bytes, int]]:
    """(value, key, partition) of ``steps`` events of each of ``runs`` runs, interleaved."""
    rng = random.Random(seed)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    return [
        (step_event(f"bench-{r}", s, rng, t0).to_json(), f"bench-{r}".encode(), r % PARTITIONS)
        for s in range(steps)
        for r in range(runs)
    ]


class NoState:
    """A state reader with nothing stored (the in-process parts measure pickling, not Kafka)."""

    topic = topics.STATE
    origin: dict[str, tuple[int, int]] = {}

    def read(self, partitions: set[int]) -> dict[str, bytes | None]:
        return {}


def snapshotting_processor() -> TelemetryProcessor:
    """A processor with state on, nothing stored and no timed snapshots: they are taken when asked."""
    return TelemetryProcessor(
        RunwatchConfig(),
        SECRET,
        state_reader=NoState(),
        state=StateOptions(interval_s=1e9),
        state_secret=STATE_SECRET,
    )
