"""Where a live page announces itself: a small JSON file beside the embedded store it serves
(``.runwatch/clickhouse`` -> ``.runwatch/clickhouse.page.json``), so a command given the same DSN finds it."""

from __future__ import annotations

from pathlib import Path


def chdb_path(dsn: str) -> Path | None:
    """The folder of an embedded store's DSN (``chdb:///path``), resolved; None for a server's DSN."""
    if not dsn.startswith("chdb://"):
        return None
    return Path(dsn.removeprefix("chdb://")).resolve()


def page_file(dsn: str) -> Path | None:
    """The announcement file of the page serving ``dsn``'s embedded store; None for a server's DSN (a
    ClickHouse server has no lock: commands read it directly)."""
    path = chdb_path(dsn)
    return None if path is None else path.with_name(path.name + ".page.json")
