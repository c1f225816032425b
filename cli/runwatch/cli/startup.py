"""What the long-running commands (worker, sink, remediate) check before they start: the broker and
ClickHouse answer within a deadline that holds even when the client library blocks
(cli/runwatch/cli/reach.py), or the command exits non-zero with one line naming what it could not reach."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import current_command, require_engine
from runwatch.cli.reach import CONNECT_TIMEOUT_S, Unreachable, call_within, kafka_partition_counts
from runwatch.producer.wire import topics

if TYPE_CHECKING:
    from runwatch.sinks.clickhouse import ClickHouseSink


def broker_partitions(bootstrap: str, names: Iterable[str]) -> dict[str, int | None]:
    """Each topic's partition count (None: missing), or exit 1 if the broker does not answer in time."""
    try:
        return kafka_partition_counts(bootstrap, list(names))
    except Unreachable as exc:
        raise CommandError(
            f"{exc} (is --bootstrap / ${topics.BOOTSTRAP_ENV} right, and the broker up?)"
        ) from None


def require_topics(
    bootstrap: str, names: Iterable[str], optional: Iterable[str] = ()
) -> dict[str, int | None]:
    """``broker_partitions`` of ``names`` and ``optional``; exit 1 naming the first of ``names`` that does
    not exist."""
    names = list(names)
    counts = broker_partitions(bootstrap, [*names, *optional])
    for name in names:
        if counts[name] is None:
            raise CommandError(
                f"the topic {name} does not exist on {bootstrap} (`runwatch broker "
                "--bootstrap ...` creates runwatch's topics; deploy/ lists them)"
            )
    return counts


def open_store(dsn: str | None) -> ClickHouseSink:
    """The ClickHouse at ``dsn`` (default: the embedded one), migrated; exit 1 with one line if it cannot
    be opened or does not answer within CONNECT_TIMEOUT_S."""
    from runwatch.sinks.clickhouse import ClickHouseSink, default_dsn

    dsn = dsn or default_dsn()
    require_engine(current_command(), dsn)
    # clickhouse-connect logs its failed attempt before raising; the exception says it in our one line
    logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())

    def opened() -> ClickHouseSink:
        store = ClickHouseSink(dsn)
        try:
            store.migrate()
        except BaseException:
            store.close()
            raise
        return store

    try:
        return call_within(opened, CONNECT_TIMEOUT_S, f"ClickHouse at {redacted(dsn)}")
    except Unreachable as exc:
        raise CommandError(str(exc)) from None


def redacted(dsn: str) -> str:
    """The DSN without its password, for logs and errors."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
