"""What runwatch's own instrumentation uses of a :class:`~runwatch.producer.publish.run_watch.RunWatch`.

Structural types (``typing.Protocol``): a ``RunWatch`` (and a ``JsonlRecorder``) is each of them without
saying so, and a test may hand the heartbeat a smaller fake. They type the seams in place of ``Any``:
:class:`HeartbeatPublisher` for the heartbeat thread (instrument/heartbeat.py), :class:`Publisher` for a
``Watcher`` (instrument/watch.py), :class:`ActionPublisher` for the action listener and its applier
(actions/). Nothing here imports torch, Kafka or the publisher itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from runwatch.contract.schema import Action, CheckpointRef
from runwatch.producer.publish.delivery import Delivery


class HeartbeatPublisher(Protocol):
    """What the heartbeat thread calls. It probes, at run time, which optional keywords ``heartbeat`` takes
    (``host``, ``host_load``, ``gpu``) and whether there is an ``evidence`` at all, so that an older or
    smaller publisher still beats; a ``RunWatch`` has all of them."""

    def heartbeat(
        self,
        step: int | None,
        phase: str = "train",
        time_in_phase_s: float = 0.0,
        in_sync: bool | None = None,
        interval_s: float | None = None,
        host_load: dict[str, Any] | None = None,
        gpu: dict[str, Any] | None = None,
        host: str | None = None,
    ) -> bool: ...

    def evidence(
        self,
        step: int | None,
        *,
        threads: list[Any],
        reason: str = "no_progress",
        phase: str = "train",
        seconds_since_step: float | None = None,
        source: str = "current_frames",
        flight_recorder: str | None = None,
        flight_recorder_status: str | None = None,
    ) -> bool: ...


class Publisher(HeartbeatPublisher, Protocol):
    """What a ``Watcher`` publishes through: steps and evals (with only the fields their events declare:
    an unknown keyword raises ``UnknownFieldError``), and its heartbeat's beats and evidence."""

    @property
    def run_id(self) -> str: ...

    @property
    def rank(self) -> int: ...

    def step(self, step: int, *, extra: Mapping[str, Any] | None = None, **fields: Any) -> bool: ...

    def eval(
        self,
        step: int,
        split: str = "val",
        loss: float | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool: ...


class ActionPublisher(Protocol):
    """What the action listener and its applier use: the run they listen for (its id, rank, attempt, broker
    and spool), the checkpoints and LR a rollback restores, and the acknowledgements they send."""

    @property
    def run_id(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def attempt(self) -> str | None: ...

    @property
    def bootstrap(self) -> str: ...

    @property
    def spool_path(self) -> Path | None: ...

    @property
    def delivery(self) -> Delivery: ...

    @property
    def checkpoints(self) -> list[CheckpointRef]: ...

    @property
    def initial_lr(self) -> list[float] | None: ...

    def track_lr(self, optimizer: Any) -> None: ...

    def note_stop(self, action: Action) -> None: ...

    def ack(self, *, extra: Mapping[str, Any] | None = None, **fields: Any) -> bool: ...
