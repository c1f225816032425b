"""A message that could not be processed, bounded so that it always fits on the dead-letter topic."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Literal

from pydantic import Field

from runwatch.contract.messages.base import WireModel, utc_now

DEADLETTER_RAW_MAX_BYTES = 4096  # a dead letter carries at most this much of the message it stands for
_DEADLETTER_TEXT_MAX = 2000  # reason and traceback: enough to act on, never the message again


class DeadLetter(WireModel):
    """Why a message could not be processed: the reason, where it came from, its size and hash,
    and at most the first ``DEADLETTER_RAW_MAX_BYTES`` of it, so that a dead letter always fits
    on its topic whatever was sent. ``stage`` says who refused it: ``decode`` (the worker's
    validation), ``detector`` (an error while a detector handled a valid event: ``detector_error``)
    ``sink`` (a row ClickHouse refused) or ``budget`` (a summary of a run's events shed over its
    budget by the worker, worker/runwatch/worker/run_budget.py: no value, ``size`` 0)."""

    reason: str
    source_topic: str
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    stage: Literal["decode", "detector", "sink", "budget"] = "decode"
    size: int = Field(default=0, ge=0, description="bytes of the original message value (0 for a null value)")
    sha256: str | None = Field(
        default=None, description="hex SHA-256 of the original value; absent for a null value"
    )
    raw: str = Field(description="the first bytes of the value, as UTF-8 with replacement characters")
    raw_truncated: bool = False
    traceback: str | None = None
    ts: datetime = Field(default_factory=utc_now)

    @classmethod
    def for_message(
        cls,
        reason: str,
        raw: bytes | None,
        *,
        source_topic: str,
        partition: int | None = None,
        offset: int | None = None,
        key: bytes | None = None,
        stage: Literal["decode", "detector", "sink", "budget"] = "decode",
        traceback: str | None = None,
    ) -> DeadLetter:
        """A dead letter for ``raw`` (a message value, possibly None) that is bounded in size."""
        value = raw if raw is not None else b""
        head = value[:DEADLETTER_RAW_MAX_BYTES]
        return cls(
            reason=_clip(reason, _DEADLETTER_TEXT_MAX),
            source_topic=source_topic,
            partition=partition,
            offset=offset,
            key=_clip(key.decode(errors="replace"), 256) if key is not None else None,
            stage=stage,
            size=len(value),
            sha256=hashlib.sha256(value).hexdigest() if raw is not None else None,
            raw=head.decode(errors="replace"),
            raw_truncated=len(value) > len(head),
            traceback=_clip(traceback, 4 * _DEADLETTER_TEXT_MAX) if traceback else None,
        )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
