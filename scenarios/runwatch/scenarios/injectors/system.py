"""Faults of time and memory: throughput drifting, data waits, a memory leak, fragmentation, a stall."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from runwatch.scenarios.injectors.base import FaultInjector, FaultRun
from runwatch.scenarios.tasks import Batch


@dataclass
class ThroughputDrift(FaultInjector):
    """From the onset steps take ``factor`` times as long, at once or (``ramp``) growing linearly to it by
    the end of the run. ``cause``: the cause the finding must name (``evidence["cause"]``: ``run``,
    ``unknown``, ``contention``), the label's where the run's heartbeats carry host load; None: any."""

    kind: ClassVar[str] = "throughput_drift"
    factor: float
    ramp: bool = False
    cause: str | None = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.factor}

    def label_fields(self) -> dict[str, Any]:
        cause = {} if self.cause is None else {"cause": self.cause}
        return {**super().label_fields(), **cause}

    def compute_time(self, seconds: float, step: int) -> float:
        if not self.active(step):
            return seconds
        if not self.ramp:
            return seconds * self.factor
        onset, n = self.run.onset, self.run.steps
        assert onset is not None  # active() says so
        return seconds * (1 + (self.factor - 1) * (step - onset + 1) / max(1, n - onset))


@dataclass
class DataWait(FaultInjector):
    """From the onset the wait per batch jumps to about ``jump_to_s`` seconds, or grows linearly to
    ``grow_to_step_times`` times the compute time by the end of the run."""

    kind: ClassVar[str] = "data_wait"
    jump_to_s: float | None = None
    grow_to_step_times: float | None = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.jump_to_s or self.grow_to_step_times}

    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        if not self.active(step):
            return wait
        if self.jump_to_s is not None:
            return self.jump_to_s * timing.lognormvariate(0, 0.1)
        onset, n = self.run.onset, self.run.steps
        grow = self.grow_to_step_times
        assert onset is not None and grow is not None  # active(), and no jump_to_s: grows
        return wait + grow * self.run.step_time_s * (step - onset + 1) / max(1, n - onset)


@dataclass
class MemoryLeak(FaultInjector):
    """From the onset every step's input, hidden activations and logits are kept in a list never cleared
    (needs a model with an ``encoder`` whose first layer takes the batch); with ``logits_only`` only the
    logits (a smaller leak: a metric buffer that keeps every step's outputs)."""

    kind: ClassVar[str] = "memory_leak"
    logits_only: bool = False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "leak"}

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self.retained: list[torch.Tensor] = []

    def retain(self, model: nn.Module, batch: Batch, logits: torch.Tensor, step: int) -> list[int]:
        if not self.active(step):
            return []
        with torch.no_grad():
            encoder = cast(nn.Sequential, model.encoder)  # (the class doc's model)
            h1 = encoder[0](batch.x)
            kept = [batch.x.clone(), h1, F.gelu(h1), encoder(batch.x), logits.detach().clone()]
        if self.logits_only:
            kept = kept[-1:]
        self.retained.extend(kept)  # the bug: a list that is never cleared
        return [t.numel() * t.element_size() for t in kept]


@dataclass
class MemoryFragmentation(FaultInjector):
    """From the onset every batch has a random sequence length between ``min_length`` and ``max_length``."""

    kind: ClassVar[str] = "memory_fragmentation"
    min_length: int = 16
    max_length: int = 256

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "fragmentation"}

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self.lengths = random.Random(run.seed)

    def batch_length(self, step: int) -> int | None:
        return self.lengths.randint(self.min_length, self.max_length) if self.active(step) else None


@dataclass
class Stall(FaultInjector):
    """The rank hangs for ``seconds``: in the training phase after the onset step (the run is then killed),
    or in the data loader before the step after it (then recovers). Heartbeats go on throughout."""

    kind: ClassVar[str] = "stall"
    phase: Literal["train", "dataload"]
    seconds: float

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": self.phase, "magnitude": self.seconds}

    def label_fields(self) -> dict[str, Any]:
        # the label's kind is the finding's ("stalled"); the phase it hangs in is its own field
        return {"phase": self.phase, "kind": "stalled", "magnitude": self.seconds}

    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        if self.phase == "dataload" and step == (self.run.onset or 0) + 1:
            self.run.mark_onset()
            return wait + self.seconds
        return wait

    def step_computed(self, step: int) -> None:
        pass  # the onset is when the hang starts, below or in the data wait

    def step_published(self, step: int, advance: Callable[[float], None]) -> str | None:
        if self.phase != "train" or not self.at_onset(step):
            return None
        self.run.mark_onset()
        advance(self.seconds)  # hung: the heartbeats go on, no step completes
        return "interrupted"
