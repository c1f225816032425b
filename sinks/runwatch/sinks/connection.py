"""What the sink's parts need of a ClickHouse connection, and how they say it cannot be reached.

A leaf (faust's ``types/`` is the model): ``ClickHouseSink`` (sinks/runwatch/sinks/clickhouse.py) owns its
parts (``writer``, ``runs``, ``baselines``, ``report``), and each part takes the sink as a ``Connection``,
so the parts name this protocol rather than the class that builds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class ClickHouseUnavailable(Exception):  # a state, not a bug
    """ClickHouse cannot be reached (connection refused, timeout, client closed): retry later."""


class Connection(Protocol):
    """The statements the sink's parts run: ``{db}`` in SQL is the sink's database."""

    def insert(self, table: str, rows: list[tuple[Any, ...]], columns: Sequence[str]) -> int:
        """Insert ``rows`` into ``table`` of the sink's database; returns how many."""
        ...

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Rows of ``sql``, whose ``{db}`` is the sink's database."""
        ...

    def reachable(self) -> bool:
        """Whether ClickHouse answers a trivial query."""
        ...
