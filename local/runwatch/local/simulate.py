"""A synthetic run of many ranks for ``runwatch simulate`` (issue 36): every rank's step events and
heartbeats as a synchronous data-parallel job's would be, with faults on chosen ranks, and no torch.

Pure: ``SyntheticRun`` builds the wire bytes of each step and heartbeat round (with ``orjson``, not a
model per event: a 16,384-rank step is 16,384 events), and ``parse_fault`` reads the command line's
``--fault``. Sending and pacing are the command's (cli/runwatch/cli/simulate.py).

Faults (``KIND:RANK:ARG``):

- ``hang:R:S``: rank R stops before step S and never steps again; it heartbeats, not in sync. The job is
  synchronous, so every other rank stops at S too, heartbeating in sync (waiting in the collective);
- ``slow:R:F``: rank R's own work (``compute_s``) takes F times as long; everyone's step time is the
  slowest rank's, as in a synchronous job;
- ``nan:R:S``: rank R's loss and gradient norm are NaN from step S on;
- ``spike:R:S``: rank R's loss is 20 times its usual at step S (one step);
- ``memory:R:MB``: rank R's allocated memory grows by MB every step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, get_args

import orjson

from runwatch.contract.groups import DEFAULT_GROUP_SIZE, is_split, record_key

FaultKind = Literal["hang", "slow", "nan", "spike", "memory"]
_BASE_ALLOCATED = 10 * 2**30  # bytes a rank's tensors hold before any memory fault
_MIB = 2**20


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int
    arg: float  # the step (hang, nan, spike), the factor (slow) or MiB per step (memory)


def parse_fault(text: str, ranks: int) -> Fault:
    """``KIND:RANK:ARG``, checked against the run's rank count; ``ValueError`` saying what is wrong."""
    parts = text.split(":")
    kinds = get_args(FaultKind)
    if len(parts) != 3 or parts[0] not in kinds:
        raise ValueError(f"--fault {text!r}: expected KIND:RANK:ARG with KIND one of {', '.join(kinds)}")
    kind, rank_text, arg_text = parts
    try:
        rank, arg = int(rank_text), float(arg_text)
    except ValueError:
        raise ValueError(f"--fault {text!r}: RANK must be an integer and ARG a number") from None
    if not 0 <= rank < ranks:
        raise ValueError(f"--fault {text!r}: rank {rank} is not one of the run's ranks (0-{ranks - 1})")
    if not math.isfinite(arg) or arg < 0 or (kind == "slow" and arg < 1):
        raise ValueError(f"--fault {text!r}: ARG must be finite and >= 0 (a slow factor >= 1)")
    return Fault(kind, rank, arg)  # type: ignore[arg-type] # (kind is one of FaultKind: checked above)


@dataclass
class SyntheticRun:
    """Wire bytes of one run's ranks, round by round. ``step_time_s``: a healthy step's duration."""

    run_id: str
    ranks: int
    step_time_s: float = 1.0
    faults: list[Fault] = field(default_factory=list)
    seed: int = 0
    attempt: str = "sim"
    group_size: int = DEFAULT_GROUP_SIZE  # a run of more ranks is split by rank group (contract/groups.py)

    def __post_init__(self) -> None:
        split = is_split(self.ranks, self.group_size)
        # every event of a split run says its shape, and is keyed by its rank's group
        self._shape = {"group_size": self.group_size, "world_size": self.ranks} if split else {}
        self._keys = [
            record_key(self.run_id, rank, self.group_size if split else None) for rank in range(self.ranks)
        ]
        self._rng = random.Random(self.seed)
        self._hang = min((f for f in self.faults if f.kind == "hang"), key=lambda f: f.arg, default=None)
        self._slow = {f.rank: f.arg for f in self.faults if f.kind == "slow"}
        self._nan = {f.rank: int(f.arg) for f in self.faults if f.kind == "nan"}
        self._spike = {f.rank: int(f.arg) for f in self.faults if f.kind == "spike"}
        self._memory = {f.rank: f.arg for f in self.faults if f.kind == "memory"}
        # every rank's own work is a share of the step; the job's step is its slowest rank's
        self._work = 0.8 * self.step_time_s
        self._job_step_s = max([self.step_time_s, *(self._work * f for f in self._slow.values())])

    def hung_at(self) -> int | None:
        """The step before which the job stops (a hung rank), if any."""
        return int(self._hang.arg) if self._hang is not None else None

    def key(self, rank: int) -> bytes:
        """The Kafka key of ``rank``'s events."""
        return self._keys[rank]

    def leaders(self) -> list[int]:
        """The ranks that say when the run starts and ends: rank 0, and in a split run the first rank of
        every group (as RunWatch has them)."""
        return list(range(0, self.ranks, self.group_size)) if self._shape else [0]

    def run_start(self, ts: datetime, rank: int = 0) -> bytes:
        return orjson.dumps(
            {
                "schema_version": 1,
                "event_id": f"{self.run_id}-start-{rank}",
                "run_id": self.run_id,
                "rank": rank,
                "ts": _iso(ts),
                "kind": "run_start",
                **self._shape,
                "world_size": self.ranks,
                "attempt": self.attempt,
            }
        )

    def run_end(self, ts: datetime, rank: int = 0) -> bytes:
        return orjson.dumps(
            {
                "schema_version": 1,
                "event_id": f"{self.run_id}-end-{rank}",
                "run_id": self.run_id,
                "rank": rank,
                "ts": _iso(ts),
                "kind": "run_end",
                "status": "completed",
                **self._shape,
            }
        )

    def checkpoint(self, step: int, ts: datetime) -> bytes:
        """Rank 0's checkpoint after ``step`` (what a rollback returns to)."""
        return orjson.dumps(
            {
                "schema_version": 1,
                "event_id": f"{self.run_id}-ckpt-{step}",
                "run_id": self.run_id,
                "rank": 0,
                "ts": _iso(ts),
                "kind": "checkpoint",
                "step": step,
                "uri": f"sim://{self.run_id}/step-{step}",
                **self._shape,
            }
        )

    def step(self, step: int, ts: datetime) -> Iterator[tuple[int, bytes]]:
        """Every rank's step event of ``step`` (none from the hang on)."""
        hung = self.hung_at()
        if hung is not None and step >= hung:
            return
        stamp = _iso(ts)
        noise = self._rng.gauss
        base_loss = 2.0 * math.exp(-step / 2000.0)
        for rank in range(self.ranks):
            loss: float | str = base_loss * math.exp(noise(0, 0.01))
            grad_norm: float | str = 1.0 + 0.02 * noise(0, 1)
            if rank in self._nan and step >= self._nan[rank]:
                loss = grad_norm = "NaN"
            elif self._spike.get(rank) == step:
                loss = float(loss) * 20
            allocated = _BASE_ALLOCATED + int(self._memory.get(rank, 0) * _MIB * step)
            event = {
                "schema_version": 1,
                "event_id": f"{self.run_id}-{rank}-{step}",
                "run_id": self.run_id,
                "rank": rank,
                "ts": stamp,
                "kind": "step",
                "step": step,
                "loss": loss,
                "grad_norm": grad_norm,
                "step_time_s": self._job_step_s * math.exp(noise(0, 0.01)),
                "compute_s": self._work * self._slow.get(rank, 1.0) * math.exp(noise(0, 0.01)),
                "samples_per_s": 32.0 / self._job_step_s,
                "memory": {"allocated": allocated, "reserved": allocated + 2 * 2**30},
                **self._shape,
            }
            yield rank, orjson.dumps(event)

    def heartbeats(self, step: int, ts: datetime, interval_s: float) -> Iterator[tuple[int, bytes]]:
        """Every rank's heartbeat at ``step`` (the last it completed). During a hang the hung rank is not
        in sync and the others are (waiting for it in the collective)."""
        stamp = _iso(ts)
        hung = self.hung_at()
        for rank in range(self.ranks):
            waiting = hung is not None and step >= hung - 1
            event = {
                "schema_version": 1,
                "event_id": f"{self.run_id}-hb-{rank}-{stamp}",
                "run_id": self.run_id,
                "rank": rank,
                "ts": stamp,
                "kind": "heartbeat",
                "step": step,
                "phase": "train",
                "in_sync": waiting and rank != self._hang.rank if self._hang is not None else False,
                "interval_s": interval_s,
                **self._shape,
            }
            yield rank, orjson.dumps(event)


def _iso(ts: datetime) -> str:
    return ts.isoformat().replace("+00:00", "Z")
