"""``runwatch ingest``: recorded JSONL runs into ClickHouse, through the sink's own writer, with
their run summaries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import click

from runwatch.cli.failure import DSN_HELP, fail
from runwatch.cli.needs import NeedsExtra

if TYPE_CHECKING:
    from runwatch.contract.schema import TelemetryEvent

WRITE_CHUNK = 5000  # events per insert
TELEMETRY_TTL_DAYS = 90  # the telemetry table's TTL (sinks/runwatch/sinks/migrations.py)


def recordings(paths: tuple[str, ...]) -> list[Path]:
    """The JSONL files named, or found under the directories named (``*.jsonl``, recursively)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                fail(f"{path}: no *.jsonl recordings in this directory")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            fail(f"{path}: no such file or directory")
    return files


@click.command(cls=NeedsExtra, extras=["sink"])
@click.argument("paths", nargs=-1, required=True)
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help=DSN_HELP)
@click.option(
    "--loss-every",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="the summaries' loss_at_step_N: every this many steps",
)
def ingest(paths: tuple[str, ...], dsn: str | None, loss_every: int) -> None:
    """Load recorded runs (JSONL files, or directories of them) into ClickHouse and summarise them.

    Every file is read and checked before anything is written; the events go through the sink's
    own writer (idempotent: ingesting a file twice stores it once), then each run found is
    summarised into run_summaries from the events read (telemetry older than the table's 90-day TTL
    is not kept, its summary is). Exits 2 on an unreadable file or an unreachable ClickHouse."""
    from runwatch.cli.startup import open_store
    from runwatch.detectors.offline.replay import ReplayError, read_events
    from runwatch.sinks.summaries import summarize_run

    files = recordings(paths)
    loaded = []
    for path in files:
        try:
            loaded.append((path, read_events(path)))
        except ReplayError as exc:
            fail(str(exc))
    sink = open_store(dsn)  # (ingest may make the store)
    runs: dict[str, list[TelemetryEvent]] = {}  # run id -> its events, from every file (one file per rank)
    try:
        for path, events in loaded:
            for i in range(0, len(events), WRITE_CHUNK):
                sink.writer.write_events(events[i : i + WRITE_CHUNK])
            for event in events:
                runs.setdefault(event.run_id, []).append(event)
            names = set(e.run_id for e in events)
            click.echo(f"{path}: {len(events)} events of {len(names)} run(s) stored", err=True)
        for run_id, run_events in runs.items():
            run_events.sort(key=lambda e: e.ts)  # stable: a file's order within one time
            summary = summarize_run(sink, run_id, run_events, "died", loss_every)
            click.echo(
                f"run {run_id}: summary written (status {summary.status}, "
                f"{int(summary.metrics.get('steps') or 0)} steps, baseline key {summary.baseline_key})",
                err=True,
            )
    except Exception as exc:  # noqa: BLE001 - ClickHouse failing half-way: say what, exit 2
        fail(f"writing to ClickHouse at {sink.dsn} failed: {exc}")
    finally:
        sink.close()
    click.echo(f"ingested {len(files)} file(s), {len(runs)} run(s) into {sink.dsn}")
    cutoff = datetime.now(UTC) - timedelta(days=TELEMETRY_TTL_DAYS)
    expired = sum(1 for events in runs.values() for e in events if e.ts < cutoff)
    if expired:
        click.echo(
            f"note: {expired} event(s) are older than the telemetry table's {TELEMETRY_TTL_DAYS}-day TTL: "
            "ClickHouse does not keep them (their runs' summaries were written from the files, so the "
            "gate and the scan see them; their per-step bands cannot come from ClickHouse)",
            err=True,
        )
