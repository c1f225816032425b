"""``runwatch scenarios generate``: the labelled corpus; ``runwatch scenarios history``: one job's history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import require_torch


@click.group()
def scenarios() -> None:
    """Labelled training scenarios (faults and healthy runs) recorded as telemetry JSONL."""


@scenarios.command("generate", cls=NeedsExtra, extras=["torch", "detectors"])
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--only", "only", multiple=True, metavar="NAME", help="record only this scenario (repeatable)")
@click.option("--quick", is_flag=True, help="far fewer steps per scenario (for tests)")
def scenarios_generate(out_dir: str, only: tuple[str, ...], quick: bool) -> None:
    """Train every scenario on the CPU and write OUT_DIR/<name>.jsonl and OUT_DIR/labels.json."""
    import time

    require_torch("runwatch scenarios generate")  # before the imports below, which load torch
    from runwatch.scenarios.catalog import CORPUS
    from runwatch.scenarios.corpus import generate

    recorded = [sc.name for sc in CORPUS]
    unknown = [n for n in only if n not in recorded]
    if unknown:
        raise click.BadParameter(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(recorded)}",
            param_hint="--only",
        )
    total = len(only) or len(CORPUS)
    done = [0]

    def progress(name: str, label: dict[str, Any], seconds: float) -> None:
        done[0] += 1
        onset = "" if label["onset_step"] is None else f" onset step {label['onset_step']}"
        click.echo(
            f"[{done[0]:2d}/{total}] {name:36s} {label['fault']:22s} {label['steps']:4d} steps{onset}"
            f"  ({seconds:.1f} s)"
        )

    started = time.perf_counter()
    labels = generate(out_dir, list(only) or None, quick=quick, progress=progress)
    faults = sum(1 for lab in labels if lab["fault"] != "healthy")
    click.echo(
        f"{len(labels)} scenarios ({faults} faults, {len(labels) - faults} healthy) in "
        f"{time.perf_counter() - started:.1f} s -> {Path(out_dir) / 'labels.json'}"
    )


@scenarios.command("history", cls=NeedsExtra, extras=["torch", "detectors"])
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--quick", is_flag=True, help="far fewer steps per run (for tests); still every run and every day"
)
def scenarios_history(out_dir: str, quick: bool) -> None:
    """Record one job's history: a real git repository (OUT_DIR/repo), its runs over six simulated weeks on
    two declared hardware fingerprints (OUT_DIR/runs/*.jsonl) and the labelled regressions
    (OUT_DIR/labels.json)."""
    import time

    require_torch("runwatch scenarios history")  # before the imports below, which load torch
    from runwatch.scenarios.history import RecordedRun, generate

    def progress(run: RecordedRun, done: int, total: int) -> None:
        flag = " new baseline" if run.new_baseline else ""
        click.echo(
            f"[{done:2d}/{total}] day {run.day:2d} {run.fingerprint} {run.commit[:8]} {run.run_id:36s}"
            f"{flag} ({run.seconds:.1f} s)"
        )

    started = time.perf_counter()
    try:
        labels = generate(out_dir, quick=quick, progress=progress)
    except (FileExistsError, RuntimeError) as exc:
        raise CommandError(str(exc)) from None
    click.echo(
        f"{len(labels['runs'])} runs, {len(labels['regressions'])} labelled regressions, "
        f"{len(labels['benign'])} benign commits in {time.perf_counter() - started:.1f} s -> "
        f"{Path(out_dir) / 'labels.json'}"
    )
