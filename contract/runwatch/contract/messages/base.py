"""What every wire message shares: the base model (unknown fields kept, NaN/Inf as strings), the wire's
float and time types, run ids, and the envelope of every telemetry event."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from runwatch.contract import groups
from runwatch.contract.public_name import known_as_schema

SCHEMA_VERSION = 1

Phase = Literal["train", "eval", "checkpoint", "dataload", "idle"]
Severity = Literal["info", "warning", "critical"]

SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}

# A run id: ASCII letters, digits and ``. _ - : / @ + =``, at most RUN_ID_MAX_CHARS. It is the Kafka key,
# part of state keys, log lines, chat messages and command lines: nothing in it may read as markup,
# whitespace or a control character.
RUN_ID_MAX_CHARS = 256
_RUN_ID = re.compile(r"[A-Za-z0-9._:/@+=-]+", re.ASCII)


def run_id_problem(run_id: str, max_chars: int = RUN_ID_MAX_CHARS) -> str | None:
    """Why ``run_id`` is not a valid run id, or None."""
    if not run_id:
        return "run_id: empty"
    if len(run_id) > max_chars:
        return f"run_id: {len(run_id)} characters (limit {max_chars})"
    if not _RUN_ID.fullmatch(run_id):
        bad = next(c for c in run_id if not _RUN_ID.fullmatch(c))
        return (
            f"run_id: {bad!r} at position {run_id.index(bad)} is outside the run id characters "
            "(ASCII letters, digits and . _ - : / @ + =)"
        )
    return None


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


@known_as_schema
class WireModel(BaseModel):
    """Base of every wire message: keeps unknown fields, writes NaN/Inf as strings."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings", populate_by_name=True)

    def to_json(self) -> bytes:
        # pydantic's serializer, not orjson: orjson writes NaN as null, which would erase
        # the very non-finite loss a detector must see. Decoding uses orjson.
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.__module__.startswith("runwatch.contract.messages."):
            known_as_schema(cls)  # (the messages' one name: public_name.py says why)


def _parse_time(value: Any) -> Any:
    """ISO 8601 text to a datetime (strict decoding takes no other form); datetimes pass."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"not an ISO 8601 time: {value[:40]!r}") from None
    return value


def _wire_float(value: Any) -> Any:
    """The strings that stand for non-finite floats on the wire; everything else as it is."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    return value


_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
# A float on the wire: a JSON number, or "NaN"/"Infinity"/"-Infinity" (never other text).
WireFloat = Annotated[float, BeforeValidator(_wire_float)]
WireTime = Annotated[datetime, BeforeValidator(_parse_time)]


class EventBase(WireModel):
    schema_version: int = SCHEMA_VERSION
    event_id: str = Field(default_factory=new_id, min_length=1)
    run_id: str = Field(min_length=1)
    rank: int = Field(default=0, ge=0)
    ts: WireTime = Field(default_factory=utc_now)
    # A run split by rank group (groups.py, issue 36): every event of its ranks says the group size
    # and the world size, and is keyed ``<run id>#<rank // group_size>``. Absent: the run is one group, keyed
    # by its run id (every producer before the split).
    group_size: int | None = Field(default=None, ge=1, le=groups.MAX_GROUP_SIZE)
    world_size: int | None = Field(default=None, ge=1)


ELLIPSIS = "\u2026"  # the mark of a string cut short
