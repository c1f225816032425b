"""What the long-running commands (worker, sink, remediate) check before they start: the broker and
ClickHouse answer within a deadline that holds even when the client library blocks
(cli/runwatch/cli/reach.py), or the command exits non-zero with one line naming what it could not reach."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import current_command, require_engine
from runwatch.cli.reach import CONNECT_TIMEOUT_S, Unreachable, call_within, kafka_partition_counts
from runwatch.contract import topics
from runwatch.contract.logsafe import redacted

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


def writable_dir(path: Path, remedy: str) -> Path:
    """``path`` made with its parents and written to once, or exit 2 with one line saying why it cannot be
    and ``remedy`` (a read-only image, another user's folder): a service must not die later with a
    traceback."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise CommandError(f"cannot write to {path.resolve()}: {exc.strerror or exc}; {remedy}") from None
    return path


DSN_SCHEMES = ("chdb", "http", "https")


def open_store(dsn: str | None, *, create: bool = True) -> ClickHouseSink:
    """The ClickHouse at ``dsn`` (default: the embedded one), migrated; exit 2 with one line if the DSN is
    not one, if it cannot be opened or does not answer within CONNECT_TIMEOUT_S. ``create``: an embedded
    store that does not exist yet is made (the sink, the remediator, ingest); a command that only reads
    says there is nothing stored instead of making an empty store where it was run."""
    from runwatch.sinks.clickhouse import ClickHouseSink, default_dsn

    check_dsn(dsn or default_dsn(), create, default=dsn is None)
    dsn = dsn or default_dsn()
    require_engine(current_command(), dsn)
    # clickhouse-connect logs its failed attempt before raising; the exception says it in our one line
    logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())
    logging.getLogger("clickhouse_connect").propagate = False

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
    except Exception as exc:  # noqa: BLE001 - a refused connection, bad credentials: one line, redacted
        message = str(exc).replace(dsn, redacted(dsn)).splitlines()[0] if str(exc) else ""
        raise CommandError(
            f"cannot open ClickHouse at {redacted(dsn)}: {type(exc).__name__}: {message[:300]}"
        ) from None


def open_sink(dsn: str | None) -> ClickHouseSink:
    """The ClickHouse sink at ``dsn`` (default: the sink's) for a command that reads it, migrated; exits 2
    saying why when there is nothing stored there, or it cannot be opened or reached."""
    return open_store(dsn, create=False)


def check_dsn(dsn: str, create: bool, default: bool = False) -> None:
    """Exit 2 with one line when ``dsn`` is not a ClickHouse DSN, or names an embedded store that cannot
    be (``create``) or is not there."""
    from urllib.parse import urlsplit

    scheme = urlsplit(dsn).scheme
    if scheme not in DSN_SCHEMES:
        raise CommandError(
            f"{redacted(dsn)!r} is not a ClickHouse DSN: chdb:///path (the embedded store) or "
            "http(s)://user:password@host:8123"
        )
    if scheme != "chdb":
        return
    path = Path(dsn.removeprefix("chdb://")).resolve()
    if not create and not path.exists():
        raise CommandError(
            f"nothing is stored at {path}: start runwatch up (or runwatch sink) here first, or give --dsn "
            "or $RUNWATCH_CLICKHOUSE_DSN"
        )
    if create and not default and not path.parent.is_dir():  # (the default's .runwatch/ is made)
        raise CommandError(f"cannot make the store {path}: its folder {path.parent} does not exist")
