"""``RunEvents``: one rank's typed wire events, stamped with its run id, rank and clock.

Event building knows nothing of where events go: :class:`~runwatch.producer.publish.run_watch.RunWatch`
hands what it builds here to its delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from runwatch.producer.wire.schema import EventBase, run_id_problem

E = TypeVar("E", bound=EventBase)


def require_run_id(run_id: str) -> None:
    problem = run_id_problem(run_id) if isinstance(run_id, str) else "run_id: not a string"
    if problem:
        raise ValueError(f"{problem}: the worker would dead-letter every event of this run")


class RunEvents:
    """Builds one rank's events: ``run_id`` and ``rank`` filled in, ``ts`` from ``clock`` (default:
    now, UTC) unless given. A field that does not validate raises pydantic's ``ValidationError``."""

    def __init__(
        self,
        run_id: str,
        rank: int,
        clock: Callable[[], datetime] | None = None,
        split: tuple[int, int] | None = None,
    ):
        """``split``: (group size, world size) of a run split by rank group (wire/groups.py), which every
        event then says; None: the run is one group."""
        require_run_id(run_id)
        self.run_id = run_id
        self.rank = rank
        self.clock = clock
        self.split = split

    def build(self, model: type[E], **fields: Any) -> E:
        if self.clock is not None and "ts" not in fields:
            fields["ts"] = self.clock()
        if self.split is not None:
            fields["group_size"], fields["world_size"] = self.split
        return model(run_id=self.run_id, rank=self.rank, **fields)
