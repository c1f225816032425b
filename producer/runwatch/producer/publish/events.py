"""``RunEvents``: one rank's typed wire events, stamped with its run id, rank and clock.

Event building knows nothing of where events go: :class:`~runwatch.producer.publish.run_watch.RunWatch`
hands what it builds here to its delivery.

Building is strict where decoding is not: a keyword that is no field of the event's model raises
:class:`UnknownFieldError` at once, naming the nearest fields (``grad_nrom`` is a typo in training code, and
would otherwise travel as an extra field all the way to ClickHouse). A field of the run's own goes in
``extra={...}``. The wire models still keep unknown fields when they decode another client's events
(``extra="allow"``, contract/schema.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from runwatch.contract.schema import EventBase, run_id_problem, utc_now

E = TypeVar("E", bound=EventBase)


def require_run_id(run_id: str) -> None:
    problem = run_id_problem(run_id) if isinstance(run_id, str) else "run_id: not a string"
    if problem:
        raise ValueError(f"{problem}: the worker would dead-letter every event of this run")


class UnknownFieldError(TypeError):
    """A keyword that no field of the event's model declares (a ``TypeError``, as Python's own "unexpected
    keyword argument" is): its message names the nearest declared fields."""


# Each model's declared field names, learnt at its first event: the check on the step path is then one
# subset test against a frozenset, not a look at the model's fields on every call.
_DECLARED: dict[type[EventBase], frozenset[str]] = {}


def declared_fields(model: type[EventBase]) -> frozenset[str]:
    """The field names ``model`` declares (what ``RunEvents.build`` takes as keywords)."""
    names = _DECLARED.get(model)
    if names is None:
        names = _DECLARED[model] = frozenset(model.model_fields)
    return names


def unknown_field_error(model: type[EventBase], unknown: set[str] | list[str]) -> UnknownFieldError:
    """The error for keywords ``unknown`` that ``model`` does not declare, with the nearest declared ones."""
    declared = sorted(declared_fields(model))
    parts = []
    for name in sorted(unknown, key=str):
        near = difflib.get_close_matches(str(name), declared, n=3, cutoff=0.6)
        hint = f": did you mean {near[0]!r}?" if near else ""
        if len(near) > 1:
            hint += f" (or {', '.join(repr(n) for n in near[1:])})"
        parts.append(f"{model.__name__} has no field {name!r}{hint}")
    return UnknownFieldError(
        "; ".join(parts) + " (a field of your own goes in extra={...}; docs/producer.md#strict-fields)"
    )


class PendingEvent:
    """An event checked by name but not yet validated: its model and its fields (``run_id``, ``rank`` and
    ``ts`` stamped). A delivery with a thread of its own validates it there (:meth:`build`), in a batch,
    rather than in the training loop; a value that does not validate is then dropped and counted as
    ``invalid`` there, as ``RunWatch`` counts it when it builds the event itself."""

    __slots__ = ("fields", "model")

    def __init__(self, model: type[EventBase], fields: dict[str, Any]):
        self.model = model
        self.fields = fields

    def build(self) -> EventBase:
        """The event; raises pydantic's ``ValidationError`` for a field that does not validate."""
        return self.model(**self.fields)


class RunEvents:
    """Builds one rank's events: ``run_id`` and ``rank`` filled in, ``ts`` from ``clock`` (default:
    now, UTC) unless given. A keyword the model does not declare raises :class:`UnknownFieldError`; a field
    that does not validate raises pydantic's ``ValidationError``."""

    def __init__(
        self,
        run_id: str,
        rank: int,
        clock: Callable[[], datetime] | None = None,
        split: tuple[int, int] | None = None,
    ):
        """``split``: (group size, world size) of a run split by rank group (contract/groups.py), which every
        event then says; None: the run is one group."""
        require_run_id(run_id)
        self.run_id = run_id
        self.rank = rank
        self.clock = clock
        self.split = split

    def build(self, model: type[E], extra: Mapping[str, Any] | None = None, **fields: Any) -> E:
        """``model``'s event of ``fields`` (declared fields only) and ``extra`` (fields of the caller's own,
        kept as the event's extra fields: names that are no declared field)."""
        declared = _DECLARED.get(model) or declared_fields(model)
        if not declared.issuperset(fields):
            raise unknown_field_error(model, [name for name in fields if name not in declared])
        if extra:
            _check_extra(model, extra, declared)
            fields = {**extra, **fields}
        if self.clock is not None and "ts" not in fields:
            fields["ts"] = self.clock()
        if self.split is not None:
            fields["group_size"], fields["world_size"] = self.split
        return model(run_id=self.run_id, rank=self.rank, **fields)

    def pending(self, model: type[EventBase], fields: dict[str, Any]) -> PendingEvent:
        """``build`` without the validation (``fields``, declared ones only, are taken over): names are
        checked now (``UnknownFieldError``), ``ts`` is stamped now (the event's time is when it happened, not
        when it is validated), values are validated by :meth:`PendingEvent.build`."""
        declared = _DECLARED.get(model) or declared_fields(model)
        if not declared.issuperset(fields):
            raise unknown_field_error(model, [name for name in fields if name not in declared])
        if "ts" not in fields:
            fields["ts"] = self.clock() if self.clock is not None else utc_now()
        if self.split is not None:
            fields["group_size"], fields["world_size"] = self.split
        fields["run_id"], fields["rank"] = self.run_id, self.rank
        return PendingEvent(model, fields)


def _check_extra(model: type[EventBase], extra: Mapping[str, Any], declared: frozenset[str]) -> None:
    """``extra`` holds names of the caller's own only: a declared field there would pass unchecked by name."""
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra: expected a mapping of field names to values, got {type(extra).__name__}")
    bad = [name for name in extra if not isinstance(name, str) or not name]
    if bad:
        raise TypeError(f"extra: field names must be non-empty strings, got {bad[0]!r}")
    clash = sorted(declared.intersection(extra))
    if clash:
        raise TypeError(
            f"extra: {', '.join(map(repr, clash))} is a field of {model.__name__}: pass it as a keyword"
        )
